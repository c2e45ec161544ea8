"""Synthetic KV caches: a sender writes its heads into a paged cache; a receiver checks its heads."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from omni_plugins.pipeline.checksums import heads_slice, kv_full, verify
from omni_plugins.pipeline.spec import StagePlan
from omni_plugins.pipeline.stats import EdgeStats

WHICH = ("key", "value")


def paged_cache(plan: StagePlan, rid: str, rank: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
    """This rank's heads of ``rid``'s KV in a paged (NHD) cache, and the request info for the KV manager."""
    kv = plan.synthetic.kv
    assert kv is not None
    tp = plan.stage.tp_size
    local = heads_slice(kv.heads, tp, rank)
    blocks = math.ceil(kv.tokens / kv.block_size)
    layers = []
    for layer in range(kv.layers):
        pair = []
        for which in WHICH:
            paged = torch.zeros((blocks, kv.block_size, kv.heads // tp, kv.head_dim), dtype=kv.torch_dtype)
            flat = paged.view(blocks * kv.block_size, kv.heads // tp, kv.head_dim)
            flat[: kv.tokens] = kv_full(plan.synthetic.seed, rid, plan.stage_id, kv, layer, which)[:, local]
            pair.append(paged)
        layers.append((pair[0], pair[1]))
    return layers, {"seq_len": kv.tokens, "block_ids": list(range(blocks))}


def check_kv(upstream: StagePlan, rid: str, payload: Any, size: int, *, to_tp: int, rank: int, stats: EdgeStats) -> bool:
    """Verify a received KV payload (every layer, K and V); record it in ``stats``. True when it matches."""
    kv = upstream.synthetic.kv
    assert kv is not None
    mine = heads_slice(kv.heads, to_tp, rank)
    blocks = payload.get("layer_blocks") if isinstance(payload, dict) else None
    if not isinstance(blocks, dict):
        stats.mismatch(f"{rid}: KV payload has no layer_blocks")
        return False
    for which, name in zip(WHICH, ("key_cache", "value_cache"), strict=True):
        layers = blocks.get(name)
        if not isinstance(layers, list) or len(layers) != kv.layers:
            stats.mismatch(f"{rid}: KV {name} has {len(layers) if isinstance(layers, list) else 'no'} layers, expected {kv.layers}")
            return False
        for layer, got in enumerate(layers):
            expected = kv_full(upstream.synthetic.seed, rid, upstream.stage_id, kv, layer, which)[:, mine]
            problem = verify(f"{rid} KV {name}[{layer}]", got, expected)
            if problem:
                stats.mismatch(problem)
                return False
    meta = payload.get("metadata") or {}
    sent_at = meta.get("sent_at")
    stats.delivered(size, [float(sent_at)] if isinstance(sent_at, float) else [], time.time())
    return True
