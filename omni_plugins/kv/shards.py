"""Merging and slicing head-sharded KV payloads (the receive side of TP remapping).

Shards of one request from a TP group share every dim except the head dim (-2):
merging concatenates each layer on dim -2 in sender-rank order; slicing narrows
a full shard on dim -2 to one receiver rank's contiguous range of heads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from omni_plugins.kv.errors import KVPayloadError
from omni_plugins.kv.payload import CACHE_NAMES, KVPayload, LayerList, make_payload, validate_payload
from omni_plugins.kv.ranks import validate_topology

logger = logging.getLogger(__name__)


def _merge_layer(name: str, idx: int, tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    if len(present) != len(tensors):
        # Concatenating the shards that do exist would yield a layer with too few
        # heads that looks valid; a missing layer is the honest result.
        logger.warning(
            "KV merge: %s layer %d is present in %d of %d shards; treating the layer as missing", name, idx, len(present), len(tensors)
        )
        return None
    first = present[0]
    for i, t in enumerate(present[1:], start=1):
        if t.dtype != first.dtype or t.ndim != first.ndim or t.shape[:-2] != first.shape[:-2] or t.shape[-1] != first.shape[-1]:
            raise KVPayloadError(
                f"KV merge: {name} layer {idx}: shard {i} has shape {tuple(t.shape)} {t.dtype}, "
                f"shard 0 has {tuple(first.shape)} {first.dtype}; shards may differ only in the head dim (-2)"
            )
    return torch.cat(present, dim=-2).contiguous()


def merge_shards(payloads: Sequence[KVPayload]) -> KVPayload:
    """Merge the shards of several sender ranks (given in rank order) into one payload.

    Each layer is concatenated on dim -2 (heads). A layer that is ``None`` in
    every shard stays ``None``; a layer missing from only some shards becomes
    ``None`` (with a warning) rather than a tensor with too few heads. Metadata is
    the first shard's plus ``merged_remote_rank_count``. One shard is returned as
    a copy, unchanged. Raises :class:`KVPayloadError` for no shards, differing
    layer counts, or shapes that differ outside the head dim.
    """
    shards = [validate_payload(p, f"KV shard {i}") for i, p in enumerate(payloads)]
    if not shards:
        raise KVPayloadError("KV merge: no shards to merge")
    if len(shards) == 1:
        return shards[0]
    counts = {len(s["layer_blocks"]["key_cache"]) for s in shards}
    if len(counts) != 1:
        raise KVPayloadError(f"KV merge: shards have different layer counts {sorted(counts)}")
    merged: dict[str, LayerList] = {}
    for name in CACHE_NAMES:
        per_layer = zip(*(s["layer_blocks"][name] for s in shards), strict=True)
        merged[name] = [_merge_layer(name, idx, list(ts)) for idx, ts in enumerate(per_layer)]
    metadata = dict(shards[0]["metadata"])
    metadata["merged_remote_rank_count"] = len(shards)
    return make_payload(merged["key_cache"], merged["value_cache"], metadata)


def slice_for_rank(payload: KVPayload, from_tp: int, to_tp: int, local_rank: int, *, replicated_heads: bool = False) -> KVPayload:
    """Narrow a sender's full shard to receiver rank ``local_rank``'s heads (``from_tp < to_tp``).

    With ``r = to_tp // from_tp`` the receiver keeps head block ``local_rank % r``
    of ``r`` equal blocks. With ``replicated_heads`` (the mapping declares
    ``num_kv_heads``), fewer heads ``h`` than ``r`` and ``r`` a multiple of ``h``
    (GQA: each KV head is replicated on ``r // h`` receiver ranks) it keeps the
    single head ``(local_rank % r) * h // r``. Any other layer is kept whole
    (and logged), as the specification says: the receiver then holds more heads
    than its share and must pick them itself. ``sliced_for_local_rank`` is recorded in the
    metadata when at least one layer was sliced. For ``from_tp >= to_tp`` the
    payload is returned unchanged.
    """
    validate_topology(from_tp, to_tp, local_rank, role="recv")
    payload = validate_payload(payload)
    if from_tp >= to_tp:
        return payload
    r = to_tp // from_tp
    part = local_rank % r
    sliced_any = False
    out: dict[str, LayerList] = {}
    for name in CACHE_NAMES:
        layers: LayerList = []
        for idx, t in enumerate(payload["layer_blocks"][name]):
            if t is None:
                layers.append(None)
                continue
            heads = t.shape[-2]
            if heads and not heads % r:
                per = heads // r
                layers.append(t.narrow(-2, part * per, per).contiguous())
                sliced_any = True
            elif replicated_heads and heads and not r % heads:
                # GQA with fewer KV heads than receiving ranks: each KV head is
                # replicated on r // heads consecutive receiver ranks, so this
                # rank keeps the one head it replicates (vLLM's assignment).
                layers.append(t.narrow(-2, part * heads // r, 1).contiguous())
                sliced_any = True
            else:
                logger.warning(
                    "KV slice: %s layer %d has %d heads, not divisible by TP ratio %d; keeping it whole on rank %d",
                    name,
                    idx,
                    heads,
                    r,
                    local_rank,
                )
                layers.append(t)
        out[name] = layers
    metadata = dict(payload["metadata"])
    if sliced_any:
        metadata["sliced_for_local_rank"] = local_rank
    return make_payload(out["key_cache"], out["value_cache"], metadata)
