"""Deterministic payload values: a receiver recomputes exactly what it should have received.

Every value is a function of ``(seed, request id, stage, tensor name, step)``
only, so no expected data travels next to the payloads. :func:`verify`
compares dtype, shape and every element (bit-exact: ``torch.equal``).
"""

from __future__ import annotations

import hashlib

import torch

from omni_plugins.pipeline.spec import KVSpec, TensorSpec


def _seed(*parts: object) -> int:
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def generate(shape: list[int] | tuple[int, ...], dtype: torch.dtype, *key: object) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` whose values depend only on ``key``."""
    g = torch.Generator().manual_seed(_seed(*key))
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g, dtype=torch.int64).to(torch.bool)
    high = 127 if dtype in (torch.int8, torch.uint8) else 4096
    return torch.randint(0, high, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def step_output(seed: int, request_id: str, stage: int, spec: TensorSpec, step: int) -> torch.Tensor:
    """What stage ``stage`` emits for ``spec`` at ``step`` of ``request_id``."""
    return generate(spec.shape, spec.torch_dtype, seed, request_id, stage, spec.name, step)


def kv_full(seed: int, request_id: str, stage: int, kv: KVSpec, layer: int, which: str) -> torch.Tensor:
    """The whole (all heads) K or V of one layer: ``[tokens, heads, head_dim]``."""
    return generate((kv.tokens, kv.heads, kv.head_dim), kv.torch_dtype, seed, request_id, stage, f"kv.{layer}.{which}", 0)


def heads_slice(heads: int, tp: int, rank: int) -> slice:
    per = heads // tp
    return slice(rank * per, (rank + 1) * per)


def verify(what: str, got: object, expected: torch.Tensor) -> str | None:
    """None when ``got`` equals ``expected`` in type, dtype, shape and values; else a one-line reason."""
    if not isinstance(got, torch.Tensor):
        return f"{what}: expected a tensor, got {type(got).__name__}"
    if got.dtype != expected.dtype:
        return f"{what}: dtype {got.dtype} != expected {expected.dtype}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{what}: shape {tuple(got.shape)} != expected {tuple(expected.shape)}"
    if not torch.equal(got, expected):
        bad = int((got != expected).sum().item())
        return f"{what}: {bad} of {expected.numel()} values differ"
    return None
