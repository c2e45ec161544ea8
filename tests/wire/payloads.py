"""Hypothesis strategies for wire payloads and a deep comparison helper (shared by the wire tests)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from omni_plugins import wire

TORCH_DTYPES = sorted(wire.ALLOWED_TORCH_DTYPES, key=str)
NUMPY_DTYPES = sorted(wire.ALLOWED_NUMPY_DTYPES, key=str)

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return (flat % 2).bool().reshape(shape)
    t = flat.view(dtype).reshape(shape)
    if draw(st.booleans()) and t.ndim >= 2:  # a non-contiguous view of the same values
        t = t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(NUMPY_DTYPES))
    shape = draw(shapes)
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype == np.bool_:
        return (np.frombuffer(raw, dtype=np.uint8) % 2).astype(np.bool_).reshape(shape)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.binary(min_size=wire.OOB_BYTES_THRESHOLD, max_size=wire.OOB_BYTES_THRESHOLD + 100),
    tensors(),
    arrays(),
)

payloads = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
    ),
    max_leaves=12,
)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same(a: Any, b: Any) -> None:
    """Deep equality that also compares container types, dtypes and shapes; tensors bit for bit."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert _bits(a) == _bits(b)
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b
