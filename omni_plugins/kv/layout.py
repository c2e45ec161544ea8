"""Reading one request's KV out of paged caches.

Supported cache forms (``kv_caches`` argument):

1. a list with one entry per layer, each entry either
   * a tensor ``[2, num_blocks, block_size, num_heads, head_dim]`` (key = ``[0]``,
     value = ``[1]``; vLLM flash-attention layout, ``layout="nhd"``), or
     ``[2, num_blocks, num_heads, block_size, head_dim]`` (``layout="hnd"``);
   * a ``(key, value)`` pair of tensors ``[num_blocks, block_size, num_heads, head_dim]``
     (or ``[num_blocks, num_heads, block_size, head_dim]`` for ``"hnd"``);
   * ``None`` for a layer without KV;
2. a mapping ``{"key_cache": [...], "value_cache": [...]}`` of two per-layer lists of
   4-D block tensors (same two layouts).

``layout="auto"`` (the default) tells NHD from HND by which dim equals
``block_size``; when both do (``num_heads == block_size``) the caches are
ambiguous and :class:`KVLayoutError` asks for an explicit ``layout``.

Output per layer: ``[seq_len, num_heads, head_dim]``, gathered from the request's
block ids in order and truncated to ``seq_len``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from omni_plugins.kv.errors import KVLayoutError, KVPayloadError
from omni_plugins.kv.payload import LayerList

KVLayout = Literal["auto", "nhd", "hnd"]
LAYOUTS: tuple[str, ...] = ("auto", "nhd", "hnd")

_FORMS = (
    "a list of per-layer tensors [2, num_blocks, block_size, heads, head_dim] (or [2, num_blocks, heads, block_size, head_dim]), "
    "a list of per-layer (key, value) pairs of [num_blocks, block_size, heads, head_dim] tensors, "
    "or {'key_cache': [...], 'value_cache': [...]}"
)


@dataclass(frozen=True)
class PagedLayer:
    """One layer's key and value blocks, as views ``[num_blocks, block_size, heads, head_dim]``."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])


@dataclass(frozen=True)
class PagedCaches:
    """All layers of a paged cache in one normalised (NHD) view; ``None`` = layer without KV."""

    layers: list[PagedLayer | None]
    block_size: int
    layout: str

    def gather(self, block_ids: Sequence[int], seq_len: int) -> tuple[LayerList, LayerList]:
        """Return per-layer key and value tensors ``[seq_len, heads, head_dim]`` for one request."""
        ids = _check_request(block_ids, seq_len, self.block_size, self.layers)
        seq_len = int(seq_len)
        keys: LayerList = []
        values: LayerList = []
        for layer in self.layers:
            if layer is None:
                keys.append(None)
                values.append(None)
                continue
            idx = ids.to(layer.key.device)
            keys.append(_gather(layer.key, idx, seq_len))
            values.append(_gather(layer.value, idx, seq_len))
        return keys, values


def _gather(blocks: torch.Tensor, idx: torch.Tensor, seq_len: int) -> torch.Tensor:
    picked = blocks.detach().index_select(0, idx)  # [n, block_size, heads, head_dim], a copy
    return picked.flatten(0, 1)[:seq_len].contiguous()


def _as_int(value: Any, what: str) -> int:
    """``value`` as an int (Python, numpy or 0-d torch integers); bools and floats are rejected."""
    if isinstance(value, (bool, float)):
        raise KVPayloadError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise KVPayloadError(f"{what} must be an int, got {value!r}") from None


def _check_request(block_ids: Sequence[int] | torch.Tensor, seq_len: int, block_size: int, layers: list[PagedLayer | None]) -> torch.Tensor:
    seq = _as_int(seq_len, "seq_len")
    if seq <= 0:
        raise KVPayloadError(f"seq_len must be positive, got {seq}")
    if isinstance(block_ids, (str, bytes, Mapping)) or not hasattr(block_ids, "__iter__"):
        raise KVPayloadError(f"block_ids must be a sequence of ints, got {type(block_ids).__name__}")
    raw = block_ids.tolist() if hasattr(block_ids, "tolist") else list(block_ids)  # tensors and numpy arrays
    ids_list = [_as_int(b, "block_ids entries") for b in raw]
    needed = -(-seq // block_size)
    if len(ids_list) < needed:
        raise KVPayloadError(f"seq_len={seq} needs {needed} blocks of {block_size} tokens but only {len(ids_list)} block ids were given")
    ids_list = ids_list[:needed]
    num_blocks = min((layer.num_blocks for layer in layers if layer is not None), default=0)
    bad = [b for b in ids_list if not 0 <= b < num_blocks]
    if bad:
        raise KVPayloadError(f"block ids {bad[:8]} are out of range for a cache of {num_blocks} blocks")
    return torch.tensor(ids_list, dtype=torch.long)


def _detect(shape: torch.Size, block_size: int, layout: str, where: str) -> str:
    """Decide NHD/HND from a 4-D block tensor shape ``[num_blocks, a, b, head_dim]``."""
    a, b = int(shape[1]), int(shape[2])
    if layout == "nhd":
        if a != block_size:
            raise KVLayoutError(f"{where}: layout='nhd' needs dim 1 == block_size={block_size}, got shape {tuple(shape)}")
        return "nhd"
    if layout == "hnd":
        if b != block_size:
            raise KVLayoutError(f"{where}: layout='hnd' needs dim 2 == block_size={block_size}, got shape {tuple(shape)}")
        return "hnd"
    if a == block_size and b == block_size:
        raise KVLayoutError(
            f"{where}: cannot tell the cache layout from shape {tuple(shape)} because num_heads == block_size == {block_size}; "
            "pass layout='nhd' ([.., block_size, heads, head_dim]) or layout='hnd' ([.., heads, block_size, head_dim])"
        )
    if a == block_size:
        return "nhd"
    if b == block_size:
        return "hnd"
    raise KVLayoutError(f"{where}: no block dim of size block_size={block_size} in shape {tuple(shape)}; expected {_FORMS}")


def _to_nhd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "nhd" else t.transpose(1, 2)


def _split_layer(entry: Any, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One per-layer entry -> (key blocks, value blocks) 4-D tensors, or None."""
    if entry is None:
        return None
    if isinstance(entry, torch.Tensor):
        if entry.ndim != 5 or entry.shape[0] != 2:
            raise KVLayoutError(
                f"kv_caches[{i}]: a per-layer tensor must be [2, num_blocks, ..., head_dim] (5 dims), got {tuple(entry.shape)}"
            )
        return entry[0], entry[1]
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(t, torch.Tensor) for t in entry):
        return entry[0], entry[1]
    raise KVLayoutError(f"kv_caches[{i}]: unsupported entry {type(entry).__name__}; expected {_FORMS}")


def normalize_caches(kv_caches: Any, block_size: int, layout: str = "auto") -> PagedCaches:
    """Validate ``kv_caches`` (see module doc) and return a normalised :class:`PagedCaches`.

    Raises :class:`KVLayoutError` for unsupported forms, inconsistent layers and
    ambiguous layouts -- before anything is sent.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise KVLayoutError(f"block_size must be a positive int, got {block_size!r}")
    if layout not in LAYOUTS:
        raise KVLayoutError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pairs: list[tuple[torch.Tensor, torch.Tensor] | None]
    if isinstance(kv_caches, Mapping):
        keys, values = kv_caches.get("key_cache"), kv_caches.get("value_cache")
        if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)) or len(keys) != len(values):
            raise KVLayoutError("kv_caches mapping needs 'key_cache' and 'value_cache' lists of equal length")
        pairs = []
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is None and v is None:
                pairs.append(None)
            elif isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
                pairs.append((k, v))
            else:
                raise KVLayoutError(f"kv_caches layer {i}: key and value must both be tensors or both None")
    elif isinstance(kv_caches, (list, tuple)):
        pairs = [_split_layer(entry, i) for i, entry in enumerate(kv_caches)]
    else:
        raise KVLayoutError(f"unsupported kv_caches {type(kv_caches).__name__}; expected {_FORMS}")

    resolved: str | None = None
    layers: list[PagedLayer | None] = []
    for i, pair in enumerate(pairs):
        if pair is None:
            layers.append(None)
            continue
        k, v = pair
        if k.ndim != 4 or k.shape != v.shape:
            raise KVLayoutError(
                f"kv_caches layer {i}: key/value blocks must be 4-D and of equal shape, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if resolved is None:
            resolved = _detect(k.shape, block_size, layout, f"kv_caches layer {i}")
        else:
            _detect(k.shape, block_size, resolved, f"kv_caches layer {i}")
        layers.append(PagedLayer(_to_nhd(k, resolved), _to_nhd(v, resolved)))
    if resolved is None:
        raise KVLayoutError(f"kv_caches has no layer with KV ({len(layers)} entries, all None); expected {_FORMS}")
    return PagedCaches(layers=layers, block_size=block_size, layout=resolved)
