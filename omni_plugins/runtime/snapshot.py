"""Copies of outgoing payloads, so the send thread never races the runner.

A builder often returns references to the request's live lists (token ids the
runner keeps appending to) or to tensors the runner reuses next step. The send
thread encodes them later; copying containers and tensors at enqueue time
makes what is sent exactly what the builder returned.
"""

from __future__ import annotations

from typing import Any

import torch


def snapshot_payload(obj: Any) -> Any:
    """Deep-copy dicts, lists, tuples and tensors; other leaves are shared (immutable or opaque)."""
    # exact-type checks first: this runs on the model thread for every chunk
    cls = type(obj)
    if cls in _LEAVES:
        return obj
    if cls is dict:
        return _snapshot_dict(obj)
    if cls is torch.Tensor or isinstance(obj, torch.Tensor):
        return obj.detach().clone() if obj.requires_grad else obj.clone()
    if cls is list or isinstance(obj, list):
        if _LEAVES.issuperset(map(type, obj)):  # e.g. token ids: one C-level pass, no call per element
            return list(obj)
        return [snapshot_payload(v) for v in obj]
    if isinstance(obj, dict):
        return {k: snapshot_payload(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(snapshot_payload(v) for v in obj)
    return obj


def _snapshot_dict(d: dict[Any, Any]) -> dict[Any, Any]:
    """:func:`snapshot_payload` of a plain dict, with the common value types handled inline."""
    out = {}
    for k, v in d.items():
        cls = type(v)
        if cls in _LEAVES:
            out[k] = v
        elif cls is dict:
            out[k] = _snapshot_dict(v)
        elif cls is torch.Tensor and not v.requires_grad:
            out[k] = v.clone()
        elif cls is list and _LEAVES.issuperset(map(type, v)):  # e.g. token ids or timestamps
            out[k] = list(v)
        else:
            out[k] = snapshot_payload(v)
    return out


#: immutable leaf types returned as they are without further checks
_LEAVES: frozenset[type] = frozenset({int, float, bool, str, bytes, type(None)})
