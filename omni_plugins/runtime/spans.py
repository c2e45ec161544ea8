"""Token-span merge for per-token tensors that arrive in overlapping windows.

A producer may resend part of what it already sent (e.g. a widened horizon of
decode embeddings). Each window is a tensor whose rows are tokens
``[start, end)``. Merging two windows yields their union, rows of the newer
window winning where they overlap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch


class Span(NamedTuple):
    tensor: torch.Tensor
    start: int
    end: int


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    return None


def get_span(section: Mapping[str, Any], tensor_key: str, start_key: str, end_key: str) -> Span | None:
    """The span stored in ``section``, or None when it has no usable tensor/start.

    ``end`` defaults to ``start + rows``; a span whose length disagrees with the
    tensor's rows is not usable.
    """
    t = section.get(tensor_key)
    start = _as_int(section.get(start_key))
    if not isinstance(t, torch.Tensor) or t.ndim == 0 or start is None:
        return None
    end = _as_int(section.get(end_key))
    if end is None:
        end = start + int(t.shape[0])
    if end - start != int(t.shape[0]) or start < 0:
        return None
    return Span(t, start, end)


def merge_spans(old: Span | None, new: Span | None) -> Span | None:
    """Union of ``old`` and ``new`` with ``new`` winning on overlap.

    Falls back to ``new`` alone when the windows are disjoint with a gap (the
    union would have rows nobody sent) or their trailing dims differ.
    """
    if new is None:
        return old
    if old is None:
        return new
    if old.tensor.shape[1:] != new.tensor.shape[1:] or new.start > old.end or old.start > new.end:
        return new
    if old.start >= new.start and old.end <= new.end:
        return new
    start, end = min(old.start, new.start), max(old.end, new.end)
    dtype = torch.promote_types(old.tensor.dtype, new.tensor.dtype)
    out = torch.empty((end - start, *new.tensor.shape[1:]), dtype=dtype, device=new.tensor.device)
    out[old.start - start : old.end - start] = old.tensor.to(device=out.device, dtype=dtype)
    out[new.start - start : new.end - start] = new.tensor.to(dtype=dtype)
    return Span(out, start, end)
