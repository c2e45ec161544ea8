"""The KV payload: structure, validation of untrusted input, device moves.

A KV payload is::

    {"layer_blocks": {"key_cache": [T | None, ...], "value_cache": [T | None, ...]},
     "metadata": {...}}

with one entry per layer; a tensor is ``[seq_len, num_heads, head_dim]`` (dim -2
is heads, the dim shards are merged and sliced on); ``None`` marks a layer that
has no KV (e.g. a layer without attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omni_plugins.kv.errors import KVPayloadError

CACHE_NAMES: tuple[str, str] = ("key_cache", "value_cache")

KVPayload = dict[str, Any]
LayerList = list[torch.Tensor | None]


def make_payload(key_cache: LayerList, value_cache: LayerList, metadata: Mapping[str, Any]) -> KVPayload:
    """Assemble a payload from per-layer lists and metadata."""
    return {"layer_blocks": {"key_cache": list(key_cache), "value_cache": list(value_cache)}, "metadata": dict(metadata)}


def validate_payload(obj: Any, where: str = "KV payload") -> KVPayload:
    """Check ``obj`` has the payload structure and return a normalised shallow copy.

    Bytes from a backend are untrusted: this is called on every received shard
    before anything indexes into it. A layer's key and value must both be
    ``None`` or both tensors agreeing in every dim but the last. ``metadata`` may be absent (becomes ``{}``).
    Raises :class:`KVPayloadError` naming ``where`` and the offending part.
    """
    if not isinstance(obj, Mapping):
        raise KVPayloadError(f"{where}: expected a dict, got {type(obj).__name__}")
    blocks = obj.get("layer_blocks")
    if not isinstance(blocks, Mapping):
        raise KVPayloadError(f"{where}: 'layer_blocks' must be a dict, got {type(blocks).__name__}")
    lists: dict[str, LayerList] = {}
    for name in CACHE_NAMES:
        layers = blocks.get(name)
        if not isinstance(layers, (list, tuple)):
            raise KVPayloadError(f"{where}: layer_blocks[{name!r}] must be a list, got {type(layers).__name__}")
        for i, t in enumerate(layers):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise KVPayloadError(f"{where}: layer_blocks[{name!r}][{i}] must be a tensor or None, got {type(t).__name__}")
            if t.ndim < 2:
                raise KVPayloadError(
                    f"{where}: layer_blocks[{name!r}][{i}] must have >= 2 dims (..., heads, head_dim), got {tuple(t.shape)}"
                )
        lists[name] = list(layers)
    if len(lists["key_cache"]) != len(lists["value_cache"]):
        raise KVPayloadError(f"{where}: key_cache has {len(lists['key_cache'])} layers but value_cache has {len(lists['value_cache'])}")
    for i, (k, v) in enumerate(zip(lists["key_cache"], lists["value_cache"], strict=True)):
        if (k is None) != (v is None):
            raise KVPayloadError(
                f"{where}: layer {i} has a {'key' if v is None else 'value'} tensor but no {'value' if v is None else 'key'}"
            )
        if k is not None and v is not None and k.shape[:-1] != v.shape[:-1]:
            raise KVPayloadError(
                f"{where}: layer {i}: key {tuple(k.shape)} and value {tuple(v.shape)} differ in tokens or heads (all dims but the last)"
            )
    metadata = obj.get("metadata", {})
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise KVPayloadError(f"{where}: 'metadata' must be a dict, got {type(metadata).__name__}")
    return make_payload(lists["key_cache"], lists["value_cache"], metadata)


def payload_to_device(payload: KVPayload, device: torch.device | str | None) -> KVPayload:
    """Move every layer tensor to ``device`` (no-op for ``None`` or tensors already there)."""
    if device is None:
        return payload
    dev = torch.device(device)
    blocks = payload["layer_blocks"]
    for name in CACHE_NAMES:
        blocks[name] = [t if t is None or t.device == dev else t.to(dev) for t in blocks[name]]
    return payload


def payload_nbytes(payload: KVPayload) -> int:
    """Bytes held by the payload's tensors (for logs and metrics)."""
    return sum(t.numel() * t.element_size() for name in CACHE_NAMES for t in payload["layer_blocks"][name] if t is not None)
