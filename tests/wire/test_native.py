"""The compiled header path against the pure-Python reference (differential tests).

``omni_plugins.wire._native`` must encode to the same bytes as the Python encoder (or
leave the refusal to it), and decode exactly what the Python decoder decodes: both raise
:class:`WireFormatError`, or both return equal values. Inputs: generated payloads,
truncated / mutated / random messages, and hand-assembled msgpack headers with the
awkward corners of the format (non-minimal encodings, duplicate keys, bytes keys,
float32, uint64, misplaced markers, lying buffer tables).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_plugins import wire
from omni_plugins.wire import WireFormatError, _codec

from .payloads import assert_same, payloads

NATIVE_BUILT = _codec.IMPLEMENTATION == "native"
needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="omni_plugins.wire._native is not built")
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REF = msgpack.ExtType(1, b"")
TUPLE = msgpack.ExtType(2, b"")
F32, U8, BOOL, BF16, BYTES = 9, 2, 1, 8, 64


@pytest.fixture(scope="module", autouse=True)
def wire_implementation() -> Iterator[str]:
    """Overrides the conftest's parametrization: these tests run both implementations themselves."""
    yield "both"


def outcome(impl: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    with _codec.use(impl):
        try:
            return True, fn()
        except WireFormatError as exc:
            assert "malformed message" not in str(exc), f"{impl}: unchecked path: {exc}"
            return False, exc


def assert_same_bits(a: Any, b: Any) -> None:
    """``assert_same`` plus float bit patterns (a NaN payload must survive either path)."""
    assert_same(a, b)
    if isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b)
    elif isinstance(a, dict):
        for k in a:
            assert_same_bits(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b, strict=True):
            assert_same_bits(x, y)


def assert_decoders_agree(message: Any, **kw: Any) -> Any:
    ok_n, got_n = outcome("native", lambda: wire.decode(message, **kw))
    ok_p, got_p = outcome("python", lambda: wire.decode(message, **kw))
    assert ok_n == ok_p, f"native={got_n!r} python={got_p!r}"
    if ok_n:
        assert_same_bits(got_n, got_p)
    return got_p


def assert_encoders_agree(obj: Any, **kw: Any) -> None:
    ok_n, got_n = outcome("native", lambda: wire.encode(obj, **kw).to_bytes())
    ok_p, got_p = outcome("python", lambda: wire.encode(obj, **kw).to_bytes())
    assert ok_n == ok_p, f"native={got_n!r} python={got_p!r}"
    assert (got_n == got_p) if ok_n else (str(got_n) == str(got_p))


def seal(header: bytes, data: bytes = b"", *, total: int | None = None) -> bytes:
    start = wire._format.align(wire.PREFIX_SIZE + len(header))
    body = header + bytes(start - wire.PREFIX_SIZE - len(header)) + data
    size = wire.PREFIX_SIZE + len(body)
    return struct.pack("<4sBBHIIQ", wire.MAGIC, 1, 0, 0, len(header), zlib.crc32(header), size if total is None else total) + body


def forge(tree: Any, table: Any, data: bytes = b"") -> bytes:
    return seal(msgpack.packb([tree, table], use_bin_type=True), data)


# ------------------------------------------------------------------ selection and build


def test_extension_is_built_when_required() -> None:
    """The CI test command sets OMNI_REQUIRE_NATIVE=1: a silently skipped build fails here."""
    if "1" not in (os.environ.get("OMNI_REQUIRE_NATIVE"), os.environ.get("OMNI_WIRE_REQUIRE_NATIVE")):
        pytest.skip("OMNI_REQUIRE_NATIVE is not set")
    assert wire.IMPLEMENTATION == "native", "omni_plugins.wire._native was not built; the pure-Python fallback is active"


def test_pure_env_forces_the_python_path() -> None:
    code = "from omni_plugins import wire; from omni_plugins.wire import _codec; print(wire.IMPLEMENTATION, _codec.active_implementation())"
    env = {**os.environ, "OMNI_WIRE_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["python", "python"]
    env.pop("OMNI_WIRE_PURE")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [wire.IMPLEMENTATION] * 2


def test_use_switches_and_restores() -> None:
    with _codec.use("python"):
        assert _codec.active_implementation() == "python"
    with pytest.raises(ValueError, match="unknown implementation"), _codec.use("rust"):
        pass
    if not NATIVE_BUILT:
        with pytest.raises(RuntimeError, match="not built"), _codec.use("native"):
            pass


# ------------------------------------------------------------------ encoder: identical bytes

bad_leaves = st.one_of(
    st.integers(2**64, 2**70),
    st.integers(-(2**70), -(2**63) - 1),
    st.just("\ud800"),
    st.builds(object),
    st.just(np.array(["x"], dtype=object)),
    st.just(np.float32(1.5)),
    st.just(torch.zeros(2, dtype=torch.uint16) if hasattr(torch, "uint16") else object()),
)
maybe_bad = st.recursive(
    st.one_of(payloads, bad_leaves),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 3)), children, max_size=3),
    ),
    max_leaves=6,
)


@needs_native
@FUZZ
@given(payloads)
def test_encoders_write_identical_bytes(payload: Any) -> None:
    assert_encoders_agree(payload)


def assert_encode_into_matches(obj: Any) -> None:
    """``encode_into`` of both implementations: ``encode``'s bytes when the message fits, ``dest`` untouched when not,
    the same error when ``encode`` refuses."""
    ok, ref = outcome("python", lambda: wire.encode(obj).to_bytes())
    for impl in ("native", "python") if NATIVE_BUILT else ("python",):
        if not ok:
            ok_i, err = outcome(impl, lambda: wire.encode_into(obj, bytearray(1 << 16)))
            assert not ok_i and str(err) == str(ref), impl
            continue
        roomy = bytearray(b"\xa5" * (len(ref) + 70))
        with _codec.use(impl):
            assert wire.encode_into(obj, roomy) == len(ref)
            assert bytes(roomy[: len(ref)]) == ref and roomy[len(ref) :] == b"\xa5" * 70, impl
            tight = np.zeros(len(ref) - 1, dtype=np.uint8)
            assert wire.encode_into(obj, tight) == len(ref) and not tight.any(), impl  # too small: untouched


@FUZZ
@given(payloads)
def test_encode_into_writes_encode_bytes(payload: Any) -> None:
    assert_encode_into_matches(payload)


@FUZZ
@given(maybe_bad)
def test_encode_into_refuses_like_encode(payload: Any) -> None:
    assert_encode_into_matches(payload)


def test_encode_into_corner_cases() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for obj in (
        {"x": torch.randn(1024)},
        {"t": t.t(), "bf": torch.ones(3, dtype=torch.bfloat16), "c": torch.ones(2, dtype=torch.complex64), "e": torch.zeros(0)},
        {"n": np.arange(5, dtype=np.int16), "b": b"q" * 5000, "s": "x", "f": [1.5, None, True]},
        [torch.ones(2, requires_grad=True), torch.ones(4)[::2], np.ones((2, 2))[:, 0]],
        7,
    ):
        assert_encode_into_matches(obj)
    for impl in ("native", "python") if NATIVE_BUILT else ("python",):
        with _codec.use(impl), pytest.raises(WireFormatError):
            wire.encode_into({"x": torch.ones(4)}, bytes(1024))  # read-only destination


def test_many_tensors_and_a_call_back_after_them() -> None:
    """More buffer rows than the encoder keeps on its stack, then values the Python encoder handles (its rows move
    to the shared lists mid-walk): the same bytes as the Python encoder, from encode and encode_into."""
    many = [torch.full((i + 1,), float(i)) for i in range(20)]
    for obj in (
        {"many": many},
        {"many": many, "after": [np.arange(3), torch.ones(4)[::2], torch.ones(2, requires_grad=True), torch.ones(3)]},
        [torch.ones(2), b"z" * 5000, torch.zeros(3, dtype=torch.int64), np.ones((2, 2))[:, 0], *many],
    ):
        assert_encode_into_matches(obj)
        if NATIVE_BUILT:
            assert_encoders_agree(obj)


@needs_native
def test_c_api_capsule_follows_the_active_implementation() -> None:
    import types

    capsule = wire.native_c_api()
    assert type(capsule).__name__ == "PyCapsule" and "omni_plugins.wire._native.C_API" in repr(capsule)
    with _codec.use("python"):
        assert wire.native_c_api() is None and wire.native_encode_into() is None
    assert isinstance(wire.native_encode_into(), types.BuiltinFunctionType)


def test_encode_into_rechecks_a_tensor_resized_during_the_walk() -> None:
    """A call-back (a dict subclass's items()) that resizes a tensor the walk already saw: a typed error, never a read
    past the tensor's memory (both implementations; ``Encoded.buffers()`` too)."""

    def shrinking() -> dict[str, Any]:
        t = torch.ones(1024)

        class Shrinks(dict):  # type: ignore[type-arg]
            def items(self):  # type: ignore[no-untyped-def]
                t.resize_(4)
                return super().items()

        return {"t": t, "d": Shrinks(a=1)}

    for impl in ("native", "python") if NATIVE_BUILT else ("python",):
        with _codec.use(impl), pytest.raises(WireFormatError, match="changed"):
            wire.encode_into(shrinking(), bytearray(1 << 16))
        with _codec.use(impl), pytest.raises(WireFormatError, match="changed"):
            wire.encode(shrinking()).buffers()


@needs_native
@FUZZ
@given(maybe_bad)
def test_encoders_refuse_alike(payload: Any) -> None:
    """Same bytes, or the same path-naming WireFormatError (the Python encoder re-runs on a refusal)."""
    assert_encoders_agree(payload)


@needs_native
def test_encoder_corner_cases() -> None:
    from collections import OrderedDict, namedtuple
    from enum import IntEnum

    class Big(IntEnum):
        X = 2**40

    point = namedtuple("point", "x y")
    for obj in [
        None,
        True,
        0,
        -1,
        -32,
        -33,
        127,
        128,
        255,
        256,
        65535,
        65536,
        2**32 - 1,
        2**32,
        2**63 - 1,
        2**63,
        2**64 - 1,
        -(2**7),
        -(2**7) - 1,
        -(2**15) - 1,
        -(2**31) - 1,
        -(2**63),
        float("nan"),
        -0.0,
        "",
        "x" * 31,
        "x" * 32,
        "é" * 200,
        "x" * 70000,
        "x" * ((1 << 20) + 10),  # a header over 1 MiB: its checksum comes from zlib, not the table code
        b"",
        b"y" * 255,
        b"y" * 256,
        b"y" * 4095,
        b"y" * 4096,
        [],
        (),
        [()],
        {"a" * 40: {}},
        {str(i): i for i in range(20)},
        list(range(70000)),
        OrderedDict(a=1),
        point(1, 2),
        Big.X,
        [torch.ones(3), torch.ones(2, 2).t(), torch.ones(3, dtype=torch.bfloat16), np.ones(3), np.ones(3).astype(">f4")],
        torch.tensor(3.0),
        torch.ones(3, requires_grad=True),
        {1: 2},
        [2**64],
        [[[[[]]]]],
    ]:
        assert_encoders_agree(obj)
    deep: Any = 0
    for _ in range(wire.DEFAULT_LIMITS.max_depth + 1):
        deep = [deep]
    assert_encoders_agree(deep)
    assert_encoders_agree(list(range(11)), limits=wire.Limits(max_items=10))
    assert_encoders_agree([torch.ones(1)] * 10, limits=wire.Limits(max_items=10))
    assert_encoders_agree("x" * 1000, limits=wire.Limits(max_header_bytes=100))
    assert_encoders_agree(torch.ones([1] * 5), limits=wire.Limits(max_ndim=4))


@needs_native
def test_nonsense_limits_are_left_to_python() -> None:
    """Negative limits mean something to msgpack (-1: "default"); the C path hands such calls to Python."""
    odd = wire.Limits(max_items=-1)
    assert_encoders_agree([1, 2], limits=odd)
    assert_decoders_agree(wire.encode([1, 2]).to_bytes(), limits=odd)
    assert_decoders_agree(wire.encode(torch.ones(2)).to_bytes(), limits=odd)
    with pytest.raises(RuntimeError, match="already configured"):
        _codec._NATIVE_MODULE.configure(specs=[])


# ------------------------------------------------------------------ decoder: same verdicts, same values


@needs_native
@FUZZ
@given(payloads, st.booleans())
def test_decoders_agree_on_valid_messages(payload: Any, copy: bool) -> None:
    data = wire.encode(payload).to_bytes()
    assert_decoders_agree(data, copy=copy)
    assert_decoders_agree(bytearray(data), copy=copy)


SAMPLE = {"t": torch.arange(6.0).reshape(2, 3), "n": np.arange(3), "m": torch.tensor([True]), "l": [1, ("a", None), b"z" * 4100], "f": 0.5}
SAMPLE_BYTES = wire.encode(SAMPLE).to_bytes()


@needs_native
def test_decoders_agree_on_every_truncation() -> None:
    for n in range(len(SAMPLE_BYTES) + 1):
        assert_decoders_agree(SAMPLE_BYTES[:n])


@needs_native
@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(SAMPLE_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=6), st.booleans(), st.booleans()
)
def test_decoders_agree_on_mutations(mutations: list[tuple[int, int]], resealed: bool, copy: bool) -> None:
    buf = bytearray(SAMPLE_BYTES)
    for pos, value in mutations:
        buf[pos] = value
    if resealed:
        hlen = struct.unpack_from("<I", buf, 8)[0]
        struct.pack_into("<I", buf, 12, zlib.crc32(buf[24 : 24 + hlen]))
    assert_decoders_agree(bytes(buf), copy=copy)


@needs_native
@FUZZ
@given(st.binary(max_size=300))
def test_decoders_agree_on_random_bytes(data: bytes) -> None:
    assert_decoders_agree(data)
    assert_decoders_agree(SAMPLE_BYTES[:24] + data)
    assert_decoders_agree(seal(data))


# Hand-assembled msgpack, so that encodings msgpack.packb never writes appear too.


def _be(fmt: str, v: int) -> bytes:
    return struct.pack(">" + fmt, v)


def _ints() -> st.SearchStrategy[bytes]:
    small = st.integers(0, 127).map(lambda v: bytes([v]))
    neg = st.integers(-32, -1).map(lambda v: _be("b", v))
    wide = st.tuples(
        st.sampled_from([("B", 0xCC), ("H", 0xCD), ("I", 0xCE), ("Q", 0xCF), ("b", 0xD0), ("h", 0xD1), ("i", 0xD2), ("q", 0xD3)]),
        st.integers(0, 2**64 - 1),
    ).map(lambda t: bytes([t[0][1]]) + (t[1] % (1 << (8 * struct.calcsize(t[0][0])))).to_bytes(struct.calcsize(t[0][0]), "big"))
    return st.one_of(small, neg, wide)


def _raw(prefixes: tuple[int | None, int, int], payload: bytes) -> bytes:
    fix, b8, b16 = prefixes
    n = len(payload)
    if fix is not None and n < 32:
        return bytes([fix | n]) + payload
    if n < 256:
        return bytes([b8, n]) + payload
    return bytes([b16]) + _be("H", n) + payload


_text = st.one_of(st.text(max_size=6).map(lambda s: s.encode("utf-8", "surrogatepass")), st.binary(max_size=4))
strs = _text.map(lambda b: _raw((0xA0, 0xD9, 0xDA), b))
str8s = _text.map(lambda b: bytes([0xD9, len(b)]) + b)
bins = st.binary(max_size=6).map(lambda b: bytes([0xC4, len(b)]) + b)
floats = st.one_of(
    st.binary(min_size=4, max_size=4).map(lambda b: b"\xca" + b), st.binary(min_size=8, max_size=8).map(lambda b: b"\xcb" + b)
)
exts = st.one_of(
    st.sampled_from(
        [
            b"\xc7\x00\x01",
            b"\xc7\x00\x02",
            b"\xc8\x00\x00\x01",
            b"\xc9\x00\x00\x00\x00\x02",
            b"\xc7\x00\xff",
            b"\xc7\x00\x03",
            b"\xd4\x01\x00",
            b"\xc7\x01\x01\x00",
        ]
    ),
)
misc = st.sampled_from([b"\xc0", b"\xc2", b"\xc3", b"\xc1"])
keys = st.one_of(st.sampled_from([b"\xa1a", b"\xa1b", b"\xd9\x01a", b"\xc4\x01a", b"\x01"]), strs)


def _containers(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    arrays = st.lists(children, max_size=4).flatmap(
        lambda items: st.sampled_from([bytes([0x90 | len(items)]), b"\xdc" + _be("H", len(items)), b"\xdd" + _be("I", len(items))]).map(
            lambda h: h + b"".join(items)
        )
    )
    maps = st.lists(st.tuples(keys, children), max_size=4).flatmap(
        lambda pairs: st.sampled_from([bytes([0x80 | len(pairs)]), b"\xde" + _be("H", len(pairs))]).map(
            lambda h: h + b"".join(k + v for k, v in pairs)
        )
    )
    return st.one_of(arrays, maps)


trees = st.recursive(st.one_of(_ints(), strs, str8s, bins, floats, exts, misc), _containers, max_leaves=10)

rows = st.tuples(
    st.sampled_from([F32, U8, BOOL, BF16, BYTES, 42, 0, 99, -1]),
    st.sampled_from([0, 64, 128, 1, -64, 2**63]),
    st.sampled_from([0, 1, 4, 8, 16, 2**62]),
    st.one_of(st.lists(st.sampled_from([0, 1, 2, 4, -1, 2**62, 2**63]), max_size=3), st.just("x")),
).map(list)


@needs_native
@FUZZ
@given(trees, st.lists(rows, max_size=3), st.binary(max_size=200), st.booleans(), st.booleans())
def test_decoders_agree_on_assembled_headers(tree: bytes, table: list[Any], data: bytes, raw_table: bool, copy: bool) -> None:
    table_bytes = msgpack.packb(table) if not raw_table else b"\x90"
    assert_decoders_agree(seal(b"\x92" + tree + table_bytes, data), copy=copy)
    assert_decoders_agree(seal(b"\xdc\x00\x02" + tree + table_bytes, data), copy=copy)


@needs_native
@pytest.mark.parametrize(
    "header",
    [
        b"\x92\x81\xa1a\xc7\x00\x01\x91\x94\x09\x00\x04\x91\x01",  # {"a": REF} with one f32
        b"\x92\x82\xa1a\xc7\x00\x01\xa1a\x01\x91\x94\x09\x00\x04\x91\x01",  # duplicate key drops the REF: refs 0 of 1
        b"\x92\x83\xa1a\xc7\x00\x01\xa1a\xc7\x00\x01\xa1b\x02\x91\x94\x09\x00\x04\x91\x01",  # duplicate key, surviving REF
        b"\x92\x82\xa1a\x81\xc4\x01k\x01\xa1a\x02\x90",  # a bytes key inside a dropped value
        b"\x92\x82\xa1a\x92\x01\xc7\x00\x02\xa1a\x02\x90",  # a misplaced tuple marker inside a dropped value
        b"\x92\x81\xc4\x01a\x01\x90",  # a bytes key that survives
        b"\x92\x81\x01\x01\x90",  # an int key
        b"\x92\xc7\x00\x02\x90",  # a tuple marker as the root
        b"\x92\x92\xc7\x00\x02\x01\x90",  # (1,)
        b"\x92\x91\xc7\x00\x02\x90",  # ()
        b"\x92\xc8\x00\x00\x01\x91\x94\x09\x00\x04\x91\x01",  # REF as ext16
        b"\x92\xca\x7f\x80\x00\x01\x90",  # float32 signalling NaN
        b"\x92\xca\x3f\xc0\x00\x00\x90",  # float32 1.5
        b"\x92\xcf\xff\xff\xff\xff\xff\xff\xff\xff\x90",  # uint64 max
        b"\x92\xd3\x80\x00\x00\x00\x00\x00\x00\x00\x90",  # int64 min
        b"\x92\xa2\xed\xa0\x90",  # a UTF-8 encoded surrogate
        b"\x92\xc0\x90\x00",  # trailing byte
        b"\x92\xc0",  # no table
        b"\x93\xc0\x90\x90",  # a triple
        b"\x92\xc0\x91\x94\x09\x00\x04\x91\x01",  # an unreferenced buffer
        b"\x92\x92\xc7\x00\x01\xc7\x00\x01\x91\x94\x09\x00\x04\x91\x01",  # two refs, one buffer
        b"\x92\xc7\x00\x01\x91\x94\x01\x00\x02\x91\x02",  # bool data with a 2 in it
        b"\x92\xc7\x00\x01\x91\x94\x40\x00\x03\x92\x03\x01",  # bytes with a 2-d shape
        b"\x92\xc7\x00\x01\x91\x94\x09\x00\x00\x90",  # a 0-d shape with 0 bytes (4 needed)
        b"\x92\xc7\x00\x01\x91\x94\x09\x00\x04\x90",  # a 0-d f32
        b"\x92\xc7\x00\x01\x91\x94\x09\x00\x00\x92\x00\xcf\x40\x00\x00\x00\x00\x00\x00\x00",  # [0, 2**62]
        b"\x92\xc7\x00\x01\x91\x94\x09\x00\x00\x92\x00\xcf\x10\x00\x00\x00\x00\x00\x00\x00",  # [0, 2**60] (extent 2**62)
        b"\x92\xc7\x00\x01\x91\x94\x09\x01\x04\x91\x01",  # unaligned
        b"\x92\xc7\x00\x01\x91\x94\x09\xd0\xc0\x04\x91\x01",  # negative offset
        b"\x92\xc7\x00\x01\x91\x94\xc3\x00\x04\x91\x01",  # a bool code
        b"\x92\xc7\x00\x01\x91\x94\x09\x00\x04\x91\xc3",  # a bool dimension
        b"\x92\xc7\x00\x01\x91\x95\x09\x00\x04\x91\x01\x00",  # a row of five
        b"\x92\xc7\x00\x01\x91\x94\x08\x00\x04\x91\x02",  # bfloat16
        b"\x92\x91" + b"\x91" * 70 + b"\xc0\x90",  # deeper than max_depth
        b"\x92" + b"\x91" * 2000 + b"\xc0\x90",  # deeper than msgpack's stack
        b"\x92\xdd\xff\xff\xff\xff\x90",  # a lying array length
        b"\x92\xdf\x00\x10\x00\x00\x90",  # a map longer than max_items
        b"\x92\xc1\x90",  # the reserved byte
    ],
)
def test_decoders_agree_on_corner_cases(header: bytes) -> None:
    data = bytes(range(2, 130))
    for copy in (False, True):
        assert_decoders_agree(seal(header, data), copy=copy)
        assert_decoders_agree(bytearray(seal(header, data)), copy=copy)


@needs_native
def test_decoders_agree_on_buffer_kinds() -> None:
    data = wire.encode({"a": torch.arange(10, dtype=torch.int32), "b": np.ones((2, 2))}).to_bytes()
    padded = data + b"\xee" * 100  # bytes after the declared length are ignored
    for buf in (
        data,
        bytearray(padded),
        memoryview(bytearray(data)),
        np.frombuffer(bytearray(data), dtype=np.uint8),
        memoryview(data).cast("B", (len(data) // 4, 4)) if len(data) % 4 == 0 else data,
    ):
        for copy in (False, True):
            assert_decoders_agree(buf, copy=copy)
    for bad in (None, 12, "text", memoryview(bytearray(data))[::2]):
        assert_decoders_agree(bad)
    assert_decoders_agree(wire.encode([1, 2, 3]).to_bytes(), limits=wire.Limits(max_items=2))
    assert_decoders_agree(wire.encode([[1]] * 3).to_bytes(), limits=wire.Limits(max_depth=1))
    assert_decoders_agree(wire.encode(torch.ones([1] * 5)).to_bytes(), limits=wire.Limits(max_ndim=4))
    assert_decoders_agree(wire.encode("x" * 200).to_bytes(), limits=wire.Limits(max_header_bytes=100))


@needs_native
def test_checksum_matches_zlib() -> None:
    rng = np.random.default_rng(7)
    for n in [*range(20), 63, 64, 65, 1000, 4097, (1 << 20) + 3]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _codec._NATIVE_MODULE.crc32(data) == zlib.crc32(data)
    big = wire.encode({"s": "y" * ((1 << 20) + 100)}).to_bytes()
    assert_decoders_agree(big)
    corrupted = bytearray(big)
    corrupted[1000] ^= 1
    assert_decoders_agree(bytes(corrupted))


@needs_native
def test_native_views_share_memory_and_keep_the_buffer_alive() -> None:
    data = bytearray(wire.encode({"t": torch.arange(8, dtype=torch.float32)}).to_bytes())
    with _codec.use("native"):
        out = wire.decode(data)
        out["t"][0] = 42.0
        assert 42.0 in np.frombuffer(data, dtype=np.float32)
        copied = wire.decode(data, copy=True)
    copied["t"][1] = -1.0
    assert -1.0 not in np.frombuffer(data, dtype=np.float32)
    with pytest.raises(BufferError):
        data.extend(b"x")  # the view still exports the buffer


# ------------------------------------------------------------------ references and memory


@needs_native
def test_no_reference_or_memory_leaks() -> None:
    """Many calls through every exit of the C code leave reference counts and traced memory flat."""
    payload = {"request_id": "req-0001", "step": 7, "hidden": torch.randn(64), "nested": [(1, "x"), {"b": b"q" * 5000}], "n": np.ones(3)}
    good = wire.encode(payload).to_bytes()
    readonly = bytes(good)
    mutated = bytearray(good)
    mutated[30] ^= 0xFF  # inside the header: checksum mismatch
    dup = seal(b"\x92\x82\xa1a\xc7\x00\x01\xa1a\x01\x91\x94\x09\x00\x04\x91\x01", bytes(64))  # deferred to Python
    bad_table = seal(b"\x92\xc7\x00\x01\x91\x94\x09\x01\x04\x91\x01", bytes(64))
    many = {"t": [torch.ones(4)] * 12, "after": [np.ones(2)]}  # C rows (more than the stack holds), then a call-back
    watched = [wire._encode.REF, wire._encode.TUPLE, torch.float32, torch.bfloat16, np.dtype(np.float32), _codec._DEFER, None, True]

    def exercise() -> None:
        with _codec.use("native"):
            wire.encode(payload)
            wire.encode_into(payload, bytearray(len(good)))
            wire.encode_into(payload, bytearray(10))
            wire.encode_into(many, bytearray(1 << 14))  # more rows than the encoder's stack holds
            wire.encode(many)
            wire.decode(bytearray(good))
            wire.decode(readonly, copy=True)
            for message in (mutated, dup, bad_table, good[:100]):
                try:
                    wire.decode(message)
                except WireFormatError:
                    pass
            for refused in ({"a": [object()]}, {"k": 2**65}, {1: 2}, {"t": [torch.ones(4)] * 12, "x": object()}):
                for call in (wire.encode, lambda obj: wire.encode_into(obj, bytearray(64))):
                    try:
                        call(refused)
                    except WireFormatError:
                        pass

    for _ in range(50):
        exercise()
    before = [sys.getrefcount(o) for o in watched]
    tracemalloc.start()
    try:
        for _ in range(50):
            exercise()
        start = tracemalloc.get_traced_memory()[0]
        for _ in range(500):
            exercise()
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    after = [sys.getrefcount(o) for o in watched]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0] * len(watched)
    assert grown < 64 * 1024, f"traced memory grew by {grown} bytes over 500 rounds"


@needs_native
@pytest.mark.parametrize("impl", ["native", "python"])
def test_a_long_unreferenced_table_is_refused_without_a_second_parse(impl: str) -> None:
    """A crafted table (rows nobody references) must not cost a Python-object parse on top of the
    compiled one: the compiled decoder rejects it itself (no DEFER), with the Python decoder's message."""
    limits = wire.Limits(max_items=64)
    empty_u8 = [U8, 0, 0, [0]]
    over_budget = forge([REF], [empty_u8] * 64)  # 64 rows + the root list's 1 item > 64
    unreferenced = forge([REF], [empty_u8] * 8)  # fits the budget; 1 ref, 8 rows
    cases = [(over_budget, "more than max_items=64"), (unreferenced, "references 1 buffers but the table has 8")]
    for message, why in cases:
        if impl == "native":
            native = _codec._NATIVE_MODULE
            with pytest.raises(WireFormatError, match=why):
                native.decode(message, False, limits)  # raised, not DEFER handed to the Python decoder
        else:
            with _codec.use("python"), pytest.raises(WireFormatError, match=why):
                wire.decode(message, limits=limits)
