"""Round trips of hand-picked payloads: values, dtypes, shapes, containers, buffer kinds."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest
import torch

from omni_plugins import wire
from omni_plugins.wire import WireFormatError, decode, encode

from .payloads import assert_same


def roundtrip(obj: Any, **kw: Any) -> Any:
    return decode(encode(obj).to_bytes(), **kw)


ALL_TORCH = sorted(wire.ALLOWED_TORCH_DTYPES, key=str)


@pytest.mark.parametrize("dtype", ALL_TORCH, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 3, 4)], ids=str)
def test_every_allowed_torch_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    n = int(np.prod(shape)) if shape else 1
    raw = torch.arange(n * dtype.itemsize, dtype=torch.int64).remainder(2 if dtype == torch.bool else 120).to(torch.uint8)
    t = raw.view(dtype).reshape(shape) if dtype != torch.bool else raw[:n].bool().reshape(shape)
    for copy in (False, True):
        assert_same(t, roundtrip(t, copy=copy))


@pytest.mark.parametrize("dtype", sorted(wire.ALLOWED_NUMPY_DTYPES, key=str), ids=str)
def test_every_allowed_numpy_dtype(dtype: np.dtype) -> None:
    a = (np.arange(12) % 2).astype(dtype).reshape(3, 4)
    assert_same(a, roundtrip(a))
    assert_same(a, roundtrip(a, copy=True))


def test_nested_containers_and_scalars() -> None:
    payload = {
        "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
        "floats": (0.0, -1.5, float("inf"), 1e308),
        "text": "héllo ✓",
        "raw": b"\x00\xff",
        "big_raw": bytes(range(256)) * 40,
        "flags": [True, False, None],
        "empty": [{}, [], (), ""],
        "nested": {"a": [{"b": (torch.ones(2), np.zeros(3))}]},
        "tuple_of_lists": ([1], [2, [3]]),
    }
    assert_same(payload, roundtrip(payload))


def test_root_scalars_and_tensor() -> None:
    for obj in (None, 1, "x", b"", 2.5, True, torch.tensor(3), (), []):
        assert_same(obj, roundtrip(obj))


def test_non_contiguous_tensor_and_array_made_contiguous() -> None:
    t = torch.arange(24.0).reshape(4, 6).t()[1:, ::2]
    a = np.arange(24).reshape(4, 6).T[::2]
    out = roundtrip({"t": t, "a": a})
    assert_same(t.contiguous(), out["t"])
    assert_same(np.ascontiguousarray(a), out["a"])


def test_requires_grad_conj_and_big_endian_inputs() -> None:
    g = torch.ones(3, requires_grad=True) * 2
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    be = np.arange(5, dtype=">i4")
    out = roundtrip([g, c, be, torch.nn.Parameter(torch.ones(2))])
    assert_same(g.detach(), out[0])
    assert_same(c.resolve_conj(), out[1])
    assert out[2].dtype == np.dtype("int32") and out[2].tolist() == [0, 1, 2, 3, 4]
    assert type(out[3]) is torch.Tensor


def test_builtin_subclasses_travel_as_base_types() -> None:
    from collections import OrderedDict, namedtuple
    from enum import IntEnum

    class Color(IntEnum):
        RED = 1

    class Loud(str):
        def __str__(self) -> str:
            return "NOT THE VALUE"

    class Raw(bytes):
        pass

    Point = namedtuple("Point", "x y")
    out = roundtrip({"od": OrderedDict(a=1), "e": Color.RED, "p": Point(1, 2), "f": np.float64(0.5), "s": Loud("value"), "b": Raw(b"xy")})
    assert out == {"od": {"a": 1}, "e": 1, "p": (1, 2), "f": 0.5, "s": "value", "b": b"xy"}
    assert type(out["e"]) is int and type(out["p"]) is tuple and type(out["f"]) is float
    assert type(out["s"]) is str and type(out["b"]) is bytes


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        (torch.ones(2).to_sparse(), "layout"),
        (torch.ones(2, dtype=torch.uint16), "allowlist"),
        (np.array([object()], dtype=object), "allowlist"),
        (np.array(["a"]), "allowlist"),
        (object(), "not supported"),
        ({1: "a"}, "only str keys"),
        ({"a": [1, {"b": {3}}]}, "payload['a'][1]['b']"),
        (2**64, "64 bits"),
        (1j, "not supported"),
        (bytearray(b"x"), "not supported"),
        (np.int32(1), ".item()"),
        (torch.ones(2, device="meta"), "meta"),
        (np.ma.masked_array([1, 2]), "subclass"),
    ],
)
def test_encode_refuses_with_clear_error(obj: Any, needle: str) -> None:
    with pytest.raises(WireFormatError, match=None) as info:
        encode(obj)
    assert needle in str(info.value)


def test_unencodable_string_leaves_the_encoder_usable() -> None:
    with pytest.raises(WireFormatError, match="cannot encode payload header"):
        encode({"s": "\ud800"})  # lone surrogate: not UTF-8 encodable
    assert_same({"s": "ok", "t": torch.ones(2)}, roundtrip({"s": "ok", "t": torch.ones(2)}))


def test_negative_bit_views_are_resolved() -> None:
    t = torch._neg_view(torch.arange(4.0))
    assert t.is_neg()
    assert_same(-torch.arange(4.0), roundtrip(t))


def test_encode_refuses_too_deep() -> None:
    obj: Any = 1
    for _ in range(wire.DEFAULT_LIMITS.max_depth):
        obj = [obj]
    assert roundtrip(obj) == obj
    with pytest.raises(WireFormatError, match="max_depth"):
        encode([obj])


def test_decode_from_every_buffer_kind() -> None:
    payload = {"t": torch.arange(100, dtype=torch.int32), "s": "x"}
    enc = encode(payload)
    data = enc.to_bytes()
    buffers: list[Any] = [data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8).copy()]
    with mmap.mmap(-1, enc.nbytes) as m:
        enc.write_into(m)
        buffers.append(m)
        for buf in buffers:
            out = decode(buf, copy=True)
            assert torch.equal(out["t"], payload["t"]) and out["s"] == "x"
        del out


def test_buffers_concatenate_to_bytes_and_write_into() -> None:
    payload = [torch.ones(3), np.arange(7, dtype=np.int8), b"y" * 5000, torch.zeros(0)]
    enc = encode(payload)
    data = enc.to_bytes()
    assert len(data) == enc.nbytes == len(enc)
    assert b"".join(enc.buffers()) == data
    dest = bytearray(b"\xaa" * (enc.nbytes + 7))
    assert enc.write_into(dest) == enc.nbytes
    assert bytes(dest[: enc.nbytes]) == data
    assert dest[enc.nbytes :] == b"\xaa" * 7
    assert wire.peek_nbytes(data[: wire.PREFIX_SIZE]) == enc.nbytes


def test_buffers_are_aligned() -> None:
    payload = {"a": torch.ones(3), "b": torch.ones(5, dtype=torch.float64), "c": "x" * 100}
    enc = encode(payload)
    data = bytearray(enc.to_bytes())
    out = decode(data)
    base = np.frombuffer(data, dtype=np.uint8).ctypes.data
    for t in (out["a"], out["b"]):
        assert (t.data_ptr() - base) % wire.ALIGNMENT == 0


def test_write_into_checks_destination() -> None:
    enc = encode(torch.ones(10))
    with pytest.raises(WireFormatError, match="too small"):
        enc.write_into(bytearray(enc.nbytes - 1))
    with pytest.raises(WireFormatError, match="read-only"):
        enc.write_into(bytes(enc.nbytes))
    with pytest.raises(ValueError):  # WireFormatError is a ValueError
        enc.write_into(memoryview(bytearray(enc.nbytes * 2))[::2])


def test_encode_references_tensor_memory() -> None:
    t = torch.zeros(4)
    enc = encode(t)
    t[0] = 7.0  # the encoding references t: later writes are visible until written out
    assert decode(enc.to_bytes())[0].item() == 7.0
