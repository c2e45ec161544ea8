"""Synthetic KV data for tests and benchmarks (also used by other areas' tests).

:func:`full_kv` makes a request's whole-model KV deterministically from its id,
so every process of a multi-process test can rebuild the expected values
without shipping tensors around. :func:`build_paged_caches` scatters per-rank
head slices of it into paged caches with shuffled block ids, in any layout
:mod:`omni_plugins.kv.layout` reads. :func:`head_range` says which heads a rank
of a TP group owns.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Literal

import torch

LayerKV = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]
CacheForm = Literal["stacked", "pairs", "mapping"]


def _generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def full_kv(
    request_id: str,
    *,
    num_layers: int,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    missing_layers: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> LayerKV:
    """Whole-model keys and values of one request, ``[seq_len, num_heads, head_dim]`` per layer.

    Deterministic in all arguments; layers in ``missing_layers`` are ``None``.
    """
    keys: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    for layer in range(num_layers):
        if layer in missing_layers:
            keys.append(None)
            values.append(None)
            continue
        shape = (seq_len, num_heads, head_dim)
        keys.append(torch.randn(shape, generator=_generator(request_id, layer, "k")).to(dtype))
        values.append(torch.randn(shape, generator=_generator(request_id, layer, "v")).to(dtype))
    return keys, values


def head_range(num_heads: int, tp: int, rank: int) -> slice:
    """Heads owned by ``rank`` of a TP group of ``tp`` ranks (contiguous, equal blocks)."""
    per = num_heads // tp
    return slice(rank * per, (rank + 1) * per)


def shard_kv(kv: LayerKV, heads: slice) -> LayerKV:
    """The head slice ``heads`` of every layer of ``kv``."""
    keys, values = kv
    return (
        [None if t is None else t[:, heads].contiguous() for t in keys],
        [None if t is None else t[:, heads].contiguous() for t in values],
    )


def build_paged_caches(
    entries: Mapping[str, LayerKV],
    *,
    block_size: int,
    form: CacheForm = "stacked",
    layout: Literal["nhd", "hnd"] = "nhd",
    spare_blocks: int = 3,
    seed: int = 0,
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Scatter requests' KV into paged caches; return ``(kv_caches, finished_reqs)``.

    Blocks are assigned from a seeded random permutation, so block ids are out
    of order and non-contiguous; unused slots (spare blocks, the tail of each
    request's last block) hold noise, so a reader that ignores ``block_ids`` or
    ``seq_len`` gets wrong values. All requests must share layer count, heads,
    head_dim and missing layers.
    """
    first_keys = next(iter(entries.values()))[0]
    template = next(t for t in first_keys if t is not None)
    heads, head_dim, dtype = template.shape[1], template.shape[2], template.dtype
    need = {rid: -(-_seq_len(kv) // block_size) for rid, kv in entries.items()}
    num_blocks = sum(need.values()) + spare_blocks
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    finished: dict[str, dict[str, Any]] = {}
    pos = 0
    for rid, n in need.items():
        finished[rid] = {"seq_len": _seq_len(entries[rid]), "block_ids": order[pos : pos + n]}
        pos += n
    layers: list[Any] = []
    key_list: list[Any] = []
    value_list: list[Any] = []
    for layer in range(len(first_keys)):
        if first_keys[layer] is None:
            layers.append(None)
            key_list.append(None)
            value_list.append(None)
            continue
        k_blocks = torch.randn((num_blocks, block_size, heads, head_dim), generator=gen).to(dtype)
        v_blocks = torch.randn((num_blocks, block_size, heads, head_dim), generator=gen).to(dtype)
        for rid, kv in entries.items():
            ids = finished[rid]["block_ids"]
            for blocks, src in ((k_blocks, kv[0][layer]), (v_blocks, kv[1][layer])):
                assert src is not None
                for j, bid in enumerate(ids):
                    chunk = src[j * block_size : (j + 1) * block_size]
                    blocks[bid, : chunk.shape[0]] = chunk
        if layout == "hnd":
            k_blocks = k_blocks.transpose(1, 2).contiguous()
            v_blocks = v_blocks.transpose(1, 2).contiguous()
        if form == "stacked":
            layers.append(torch.stack([k_blocks, v_blocks]))
        elif form == "pairs":
            layers.append((k_blocks, v_blocks))
        key_list.append(k_blocks)
        value_list.append(v_blocks)
    caches: Any = {"key_cache": key_list, "value_cache": value_list} if form == "mapping" else layers
    return caches, finished


def _seq_len(kv: LayerKV) -> int:
    return int(next(t for t in kv[0] if t is not None).shape[0])


# -- multi-process harness: each TP rank of both stages in its own process ------------------------
#
# The entry points below run in spawned children (they are importable, as spawn needs); they talk to
# the parent only through a queue of plain tuples, and rebuild expected values with :func:`full_kv`.

KV_SHAPE = {"num_layers": 3, "head_dim": 4, "missing_layers": (1,)}


def _seq_len_of(request_id: str) -> int:
    return 5 + zlib.crc32(request_id.encode()) % 11


def _full_for(request_id: str, num_heads: int) -> LayerKV:
    return full_kv(request_id, seq_len=_seq_len_of(request_id), num_heads=num_heads, **KV_SHAPE)  # type: ignore[arg-type]


def run_sender_rank(
    connector_name: str,
    connector_config: dict[str, Any],
    from_tp: int,
    to_tp: int,
    rank: int,
    request_ids: list[str],
    num_heads: int,
    results: Any,
    done: Any,
    block_size: int = 4,
) -> None:
    """Child process: send this sender rank's head shard of each request, report, stay alive until ``done``.

    The sender keeps its connector open until the receivers have finished, because
    a connector frees the payloads it published and nobody consumed when it closes.
    """
    import omni_plugins
    from omni_plugins.config import RankMapping
    from omni_plugins.kv.manager import KVTransferManager

    conn = omni_plugins.create_connector(connector_name, connector_config)
    mgr = KVTransferManager(
        conn, stage_id=0, from_stage=0, to_stage=1, rank_mapping=RankMapping(from_tp=from_tp, to_tp=to_tp), local_rank=rank, layout="nhd"
    )
    try:
        heads = head_range(num_heads, from_tp, rank)
        entries = {rid: shard_kv(_full_for(rid, num_heads), heads) for rid in request_ids}
        caches, finished = build_paged_caches(entries, block_size=block_size, seed=rank)
        sent = mgr.handle_finished_requests_kv_transfer(finished, caches, block_size, "auto")
        results.put(("sent", rank, sent, mgr.drain_failed_sends()))
        done.wait(120)
        for rid in request_ids:
            mgr.cleanup(rid, drop_sent=False)
    finally:
        mgr.close()
        conn.close()


def run_receiver_rank(
    connector_name: str,
    connector_config: dict[str, Any],
    from_tp: int,
    to_tp: int,
    rank: int,
    request_ids: list[str],
    num_heads: int,
    results: Any,
    timeout_s: float = 60.0,
) -> None:
    """Child process: receive each request's KV, check it holds exactly this rank's heads, report.

    Reports ``("recv", rank, request_id, problems, metadata)`` with ``problems`` an
    empty list when the payload matched the expected head slice of every layer.
    """
    import omni_plugins
    from omni_plugins.config import RankMapping
    from omni_plugins.kv.manager import KVTransferManager

    conn = omni_plugins.create_connector(connector_name, connector_config)
    mgr = KVTransferManager(
        conn, stage_id=1, from_stage=0, to_stage=2, rank_mapping=RankMapping(from_tp=from_tp, to_tp=to_tp), local_rank=rank
    )
    try:
        for rid in request_ids:
            payload, size = mgr.receive_kv_cache_for_request(rid, timeout_s=timeout_s)
            problems: list[str] = []
            meta: dict[str, Any] = {}
            if payload is None or size <= 0:
                problems.append(f"nothing received (size={size})")
            else:
                meta = {k: v for k, v in payload["metadata"].items() if isinstance(v, (int, str))}
                want_k, want_v = shard_kv(_full_for(rid, num_heads), head_range(num_heads, to_tp, rank))
                for name, want in (("key_cache", want_k), ("value_cache", want_v)):
                    got = payload["layer_blocks"][name]
                    if len(got) != len(want):
                        problems.append(f"{name}: {len(got)} layers, want {len(want)}")
                        continue
                    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
                        if (g is None) != (w is None) or (g is not None and w is not None and not torch.equal(g, w)):
                            problems.append(f"{name} layer {layer}: wrong values or heads ({None if g is None else tuple(g.shape)})")
            results.put(("recv", rank, rid, problems, meta))
        mgr.close()
    finally:
        conn.close()
