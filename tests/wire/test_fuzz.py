"""Property tests: generated payloads round-trip; corrupted bytes only ever raise WireFormatError.

Every decode failure must come from a named check: the catch-all message of the
decoder's safety net ("malformed message") would mean an unchecked code path.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_plugins import wire
from omni_plugins.wire import WireFormatError, decode, encode

from .payloads import assert_same, payloads

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SAMPLE = {
    "t": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "n": np.arange(5, dtype=np.int64),
    "bf": torch.ones(2, dtype=torch.bfloat16),
    "m": torch.tensor([True, False]),
    "l": [1, "two", (3.0, None), b"x" * 5000],
}
SAMPLE_BYTES = encode(SAMPLE).to_bytes()


def decode_or_wire_error(data: Any, **kw: Any) -> Any:
    """Decode; a failure must be a WireFormatError raised by a named check."""
    try:
        return decode(data, **kw)
    except WireFormatError as exc:
        assert "malformed message" not in str(exc), f"unchecked decoder path: {exc}"
        return exc


def reseal(data: bytes | bytearray) -> bytes:
    """Recompute the header checksum so a mutated header reaches the header parser."""
    buf = bytearray(data)
    if len(buf) >= wire.PREFIX_SIZE:
        hlen = struct.unpack_from("<I", buf, 8)[0]
        struct.pack_into("<I", buf, 12, zlib.crc32(buf[wire.PREFIX_SIZE : wire.PREFIX_SIZE + hlen]))
    return bytes(buf)


def forge(tree: Any, table: Any, data: bytes = b"", *, total: int | None = None, hlen: int | None = None) -> bytes:
    """Build a message by hand (valid checksum) with an arbitrary header."""
    header = msgpack.packb([tree, table], use_bin_type=True)
    start = wire._format.align(wire.PREFIX_SIZE + len(header))
    body = header + bytes(start - wire.PREFIX_SIZE - len(header)) + data
    size = wire.PREFIX_SIZE + len(body)
    prefix = struct.pack(
        "<4sBBHIIQ",
        wire.MAGIC,
        wire.FORMAT_VERSION,
        0,
        0,
        len(header) if hlen is None else hlen,
        zlib.crc32(header),
        size if total is None else total,
    )
    return prefix + body


@FUZZ
@given(payloads)
def test_generated_payloads_round_trip(payload: Any) -> None:
    enc = encode(payload)
    data = enc.to_bytes()
    assert b"".join(enc.buffers()) == data and len(data) == enc.nbytes
    assert_same(payload_expected(payload), decode(data))
    assert_same(payload_expected(payload), decode(bytearray(data), copy=True))


def payload_expected(payload: Any) -> Any:
    """What a payload decodes to: the same values, non-contiguous tensors made contiguous."""
    if isinstance(payload, torch.Tensor):
        return payload.contiguous()
    if isinstance(payload, dict):
        return {k: payload_expected(v) for k, v in payload.items()}
    if isinstance(payload, list):
        return [payload_expected(v) for v in payload]
    if isinstance(payload, tuple):
        return tuple(payload_expected(v) for v in payload)
    return payload


def test_every_truncation_is_rejected() -> None:
    for cut in range(len(SAMPLE_BYTES)):
        err = decode_or_wire_error(SAMPLE_BYTES[:cut])
        assert isinstance(err, WireFormatError), cut
        assert "truncated" in str(err), (cut, str(err))


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_rejected(data: bytes) -> None:
    assert isinstance(decode_or_wire_error(data), WireFormatError)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_after_a_valid_prefix(data: bytes) -> None:
    prefix = struct.pack("<4sBBHIIQ", wire.MAGIC, wire.FORMAT_VERSION, 0, 0, len(data), zlib.crc32(data), wire.PREFIX_SIZE + len(data))
    decode_or_wire_error(prefix + data)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(SAMPLE_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=8), st.booleans())
def test_mutated_bytes_decode_or_raise_wire_error(mutations: list[tuple[int, int]], resealed: bool) -> None:
    buf = bytearray(SAMPLE_BYTES)
    for pos, value in mutations:
        buf[pos] = value
    data = reseal(buf) if resealed else bytes(buf)
    for copy in (False, True):
        decode_or_wire_error(data, copy=copy)


@FUZZ
@given(st.data())
def test_mutated_header_values_decode_or_raise_wire_error(data: st.DataObject) -> None:
    """Replace one value of the decoded header with an arbitrary msgpack value, reseal, decode."""
    tree, table = msgpack.unpackb(
        SAMPLE_BYTES[wire.PREFIX_SIZE : wire.PREFIX_SIZE + struct.unpack_from("<I", SAMPLE_BYTES, 8)[0]], raw=False
    )
    junk = st.one_of(
        st.integers(-(2**63), 2**64 - 1),
        st.sampled_from([0, 1, 63, 64, 2**31, 2**62, -1]),
        st.none(),
        st.text(max_size=3),
        st.lists(st.integers(-2, 2**40), max_size=4),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=3)),
    )
    row = data.draw(st.integers(0, len(table) - 1))
    col = data.draw(st.integers(0, 3))
    table[row][col] = data.draw(junk)
    tree["l"][data.draw(st.integers(0, 3))] = data.draw(junk)
    message = forge(tree, table, SAMPLE_BYTES[wire._format.align(wire.PREFIX_SIZE + struct.unpack_from("<I", SAMPLE_BYTES, 8)[0]) :])
    decode_or_wire_error(message, copy=data.draw(st.booleans()))


F32 = 9  # dtype code of torch.float32


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        (b"NOPE" + SAMPLE_BYTES[4:], "bad magic"),
        (SAMPLE_BYTES[:4] + b"\x09" + SAMPLE_BYTES[5:], "unsupported version"),
        (SAMPLE_BYTES[:5] + b"\x01" + SAMPLE_BYTES[6:], "reserved"),
        (forge([], [], hlen=2**31), "max_header_bytes"),
        (forge([], [], total=2**63), "truncated"),
        (forge([], [], total=wire.PREFIX_SIZE), "does not fit"),
        (SAMPLE_BYTES[:30] + bytes([SAMPLE_BYTES[30] ^ 1]) + SAMPLE_BYTES[31:], "checksum"),
        (forge(msgpack.ExtType(1, b""), [[99, 0, 4, [1]]], bytes(4)), "allowlist"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, 8, [1]]], bytes(8)), "!= declared length"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, 4 * 2**40, [2**20, 2**20]]], bytes(64)), "outside the message"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, -4, [-1]]], bytes(64)), "non-negative"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, 0, [2**61, 0]]]), "too large for any array"),  # zero elements, absurd extent
        (forge(msgpack.ExtType(1, b""), [[F32, 4, 4, [1]]], bytes(64)), "aligned"),
        (forge([msgpack.ExtType(1, b"")] * 2, [[F32, 0, 64, [16]], [F32, 0, 64, [16]]], bytes(128)), "overlaps"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, 4, [1]], [F32, 64, 4, [1]]], bytes(68)), "references 1 buffers"),
        (forge([msgpack.ExtType(1, b"")] * 2, [[F32, 0, 4, [1]]], bytes(4)), "references buffer 1"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, 4, [1] * 65]], bytes(4)), "max_ndim"),
        (forge(msgpack.ExtType(1, b""), [[1, 0, 2, [2]]], b"\x01\x02"), "bool data"),
        (forge(msgpack.ExtType(1, b""), [[64, 0, 2, [1, 2]]], b"ab"), "1-d shape"),
        (forge(msgpack.ExtType(1, b""), [[F32, 0, 4]], bytes(4)), "[code, offset, nbytes, shape]"),
        (forge(msgpack.ExtType(1, b""), [[F32, "0", 4, [1]]], bytes(4)), "wrong type"),
        (forge(msgpack.ExtType(1, b"x"), [], b""), "not valid msgpack"),  # ext data > max_ext_len
        (forge(msgpack.ExtType(5, b""), [], b""), "unknown msgpack extension"),
        (forge([1, msgpack.ExtType(2, b"")], []), "tuple marker outside"),
        (forge({"a": {"b": msgpack.ExtType(2, b"")}}, []), "tuple marker outside"),
        (forge(msgpack.Timestamp(1), []), "not valid msgpack"),
        (forge({b"k": 1}, []), "only str keys"),
        (forge([], {}), "not a list"),
        (forge(1, [[F32, 0, 4, [1]], [F32, 64, 4, [1]]], bytes(68)), "references 0 buffers"),
        (msgpack.packb([1, 2]), "truncated"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_check_names_itself(message: bytes, needle: str) -> None:
    err = decode_or_wire_error(message, copy=True)
    assert isinstance(err, WireFormatError), err
    assert needle in str(err), str(err)


def test_bad_header_structure() -> None:
    header = msgpack.packb({"not": "a pair"})
    start = wire._format.align(wire.PREFIX_SIZE + len(header))
    msg = struct.pack("<4sBBHIIQ", wire.MAGIC, 1, 0, 0, len(header), zlib.crc32(header), start) + header + bytes(start - 24 - len(header))
    assert "not a [tree, table] pair" in str(decode_or_wire_error(msg))


def test_depth_and_item_limits_on_decode() -> None:
    deep: Any = 0
    for _ in range(wire.DEFAULT_LIMITS.max_depth + 1):
        deep = [deep]
    err = decode_or_wire_error(forge(deep, []))
    assert isinstance(err, WireFormatError) and "max_depth" in str(err)
    very_deep: Any = 0
    for _ in range(5000):  # deeper than msgpack's own stack
        very_deep = [very_deep]
    header = b"\x91" * 5000 + b"\x00"
    start = wire._format.align(wire.PREFIX_SIZE + len(header))
    msg = struct.pack("<4sBBHIIQ", wire.MAGIC, 1, 0, 0, len(header), zlib.crc32(header), start) + header + bytes(start - 24 - len(header))
    assert isinstance(decode_or_wire_error(msg), WireFormatError)
    small = wire.Limits(max_items=10)
    err = decode_or_wire_error(encode(list(range(11))).to_bytes(), limits=small)
    assert isinstance(err, WireFormatError) and "max_array_len(10)" in str(err)  # msgpack refuses the array itself
    err = decode_or_wire_error(encode([[1] * 6, [2] * 6]).to_bytes(), limits=small)
    assert isinstance(err, WireFormatError) and "max_items" in str(err)
    with pytest.raises(WireFormatError, match="max_items"):
        encode(list(range(11)), limits=small)
    with pytest.raises(WireFormatError, match="max_header_bytes"):
        encode("x" * 1000, limits=wire.Limits(max_header_bytes=100))


def test_lying_header_allocates_nothing_large() -> None:
    """A header declaring a huge tensor over a tiny buffer is refused before any allocation."""
    import tracemalloc

    lies = [
        forge(msgpack.ExtType(1, b""), [[F32, 0, 4 * 2**34, [2**34]]], bytes(64)),
        forge([msgpack.ExtType(1, b"")] * 1000, [[F32, 0, 2**30, [2**28]]] * 1000, bytes(64)),
        forge([], [], total=2**62),
    ]
    tracemalloc.start()
    try:
        for message in lies:
            tracemalloc.reset_peak()
            assert isinstance(decode_or_wire_error(message, copy=True), WireFormatError)
            assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()


def test_non_buffer_inputs() -> None:
    for bad in (None, 12, "text", [1, 2], memoryview(bytearray(SAMPLE_BYTES))[::2]):
        assert isinstance(decode_or_wire_error(bad), WireFormatError)
    with pytest.raises(WireFormatError, match="truncated prefix"):
        wire.peek_nbytes(b"OMNW")
    with pytest.raises(WireFormatError, match="bad magic"):
        wire.peek_nbytes(b"x" * 24)
