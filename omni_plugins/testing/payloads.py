"""Payload comparison helpers for tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_payload_equal(actual: Any, expected: Any, path: str = "$") -> None:
    """Deep equality of payloads: tensor values, dtype and shape; containers and scalars exactly."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        a, e = actual.contiguous().reshape(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{path}: tensor values differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{path}: expected an ndarray, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
            f"{path}: {actual.dtype}{actual.shape} != {expected.dtype}{expected.shape}"
        )
        assert np.array_equal(actual, expected, equal_nan=expected.dtype.kind in "fc"), f"{path}: array values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual).__name__}"
        assert set(actual) == set(expected), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for k in expected:
            assert_payload_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), f"{path}: expected {type(expected).__name__}, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=False)):
            assert_payload_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and expected != expected:  # NaN
        assert isinstance(actual, float) and actual != actual, f"{path}: expected NaN, got {actual!r}"
    else:
        assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"
