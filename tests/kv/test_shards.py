"""merge_shards / slice_for_rank: head ranges, non-divisible heads, missing layers, bad input."""

from __future__ import annotations

import logging

import pytest
import torch

from omni_plugins.errors import ConfigError
from omni_plugins.kv import KVPayloadError, merge_shards, slice_for_rank
from omni_plugins.kv.payload import make_payload


def _layer(seq: int, heads: int, dim: int, base: float) -> torch.Tensor:
    """Values encode (head index + base) so a wrong head range is visible."""
    head_ids = torch.arange(heads, dtype=torch.float32).view(1, heads, 1) + base
    return head_ids.expand(seq, heads, dim).clone()


def _payload(heads: int, base: float, *, layers: int = 2, missing: tuple[int, ...] = (), meta: dict | None = None) -> dict:
    keys = [None if i in missing else _layer(5, heads, 4, base + 100 * i) for i in range(layers)]
    values = [None if i in missing else -_layer(5, heads, 4, base + 100 * i) for i in range(layers)]
    return make_payload(keys, values, meta or {"request_id": "r"})


def test_merge_concatenates_heads_in_shard_order() -> None:
    a, b = _payload(2, 0.0), _payload(2, 2.0)  # shard 1 holds global heads 2,3
    merged = merge_shards([a, b])
    for i in range(2):
        expect = _layer(5, 4, 4, 100 * i)
        assert torch.equal(merged["layer_blocks"]["key_cache"][i], expect)
        assert torch.equal(merged["layer_blocks"]["value_cache"][i], -expect)
    assert merged["metadata"] == {"request_id": "r", "merged_remote_rank_count": 2}
    assert "merged_remote_rank_count" not in a["metadata"]  # inputs untouched


def test_merge_single_shard_is_unchanged() -> None:
    a = _payload(2, 0.0)
    merged = merge_shards([a])
    assert "merged_remote_rank_count" not in merged["metadata"]
    assert torch.equal(merged["layer_blocks"]["key_cache"][0], a["layer_blocks"]["key_cache"][0])


def test_merge_missing_layer(caplog: pytest.LogCaptureFixture) -> None:
    both_missing = merge_shards([_payload(2, 0.0, missing=(1,)), _payload(2, 2.0, missing=(1,))])
    assert both_missing["layer_blocks"]["key_cache"][1] is None
    assert both_missing["layer_blocks"]["key_cache"][0].shape == (5, 4, 4)
    with caplog.at_level(logging.WARNING):
        one_missing = merge_shards([_payload(2, 0.0), _payload(2, 2.0, missing=(0,))])
    # a layer with half the heads would look valid; it becomes None instead
    assert one_missing["layer_blocks"]["key_cache"][0] is None
    assert one_missing["layer_blocks"]["value_cache"][0] is None
    assert one_missing["layer_blocks"]["key_cache"][1].shape == (5, 4, 4)
    assert "missing" in caplog.text


def test_merge_rejects_inconsistent_shards() -> None:
    with pytest.raises(KVPayloadError, match="no shards"):
        merge_shards([])
    with pytest.raises(KVPayloadError, match="layer counts"):
        merge_shards([_payload(2, 0.0, layers=2), _payload(2, 2.0, layers=3)])
    other_seq = _payload(2, 2.0)
    other_seq["layer_blocks"]["key_cache"][0] = torch.zeros(6, 2, 4)
    other_seq["layer_blocks"]["value_cache"][0] = torch.zeros(6, 2, 4)
    with pytest.raises(KVPayloadError, match="head dim"):
        merge_shards([_payload(2, 0.0), other_seq])
    with pytest.raises(KVPayloadError, match="dict"):
        merge_shards([_payload(2, 0.0), "junk"])  # type: ignore[list-item]


def test_merge_and_slice_reject_key_value_mismatch_within_a_layer() -> None:
    """An untrusted shard whose key and value disagree must not come out as a half or ragged layer."""
    lone_value = _payload(2, 2.0)
    lone_value["layer_blocks"]["key_cache"][0] = None
    with pytest.raises(KVPayloadError, match="layer 0 has a value tensor but no key"):
        merge_shards([_payload(2, 0.0), lone_value])
    ragged = _payload(4, 0.0)
    ragged["layer_blocks"]["value_cache"][1] = torch.zeros(4, 4, 4)  # 4 tokens of value, 5 of key
    with pytest.raises(KVPayloadError, match="differ in tokens or heads"):
        slice_for_rank(ragged, 1, 2, 0)


@pytest.mark.parametrize(("from_tp", "to_tp"), [(1, 2), (1, 4), (2, 4), (2, 8)])
def test_slice_gives_each_rank_its_heads(from_tp: int, to_tp: int) -> None:
    r = to_tp // from_tp
    heads_per_sender = 8 // from_tp
    per_rank = heads_per_sender // r
    for rank in range(to_tp):
        sender = rank // r
        shard = _payload(heads_per_sender, float(sender * heads_per_sender))
        out = slice_for_rank(shard, from_tp, to_tp, rank)
        for i in range(2):
            got = out["layer_blocks"]["key_cache"][i]
            assert got.shape == (5, per_rank, 4)
            assert got.is_contiguous()
            start = rank * per_rank  # global head index of the receiver's first head
            assert torch.equal(got, _layer(5, per_rank, 4, start + 100 * i))
            assert torch.equal(out["layer_blocks"]["value_cache"][i], -got)
        assert out["metadata"]["sliced_for_local_rank"] == rank


def test_slice_non_divisible_heads_kept_whole(caplog: pytest.LogCaptureFixture) -> None:
    shard = _payload(3, 0.0)
    with caplog.at_level(logging.WARNING):
        out = slice_for_rank(shard, 1, 2, 1)
    assert torch.equal(out["layer_blocks"]["key_cache"][0], shard["layer_blocks"]["key_cache"][0])
    assert "sliced_for_local_rank" not in out["metadata"]
    assert "not divisible" in caplog.text


@pytest.mark.parametrize(("from_tp", "to_tp", "kv_heads"), [(1, 4, 2), (1, 2, 1), (2, 4, 1), (1, 8, 2), (2, 8, 2)])
def test_slice_gqa_replicated_heads(from_tp: int, to_tp: int, kv_heads: int) -> None:
    """Fewer KV heads than receiving ranks, declared (``num_kv_heads``): each receiver keeps exactly the one head vLLM
    replicates on it; undeclared, the layer is kept whole as the specification says."""
    full = _payload(kv_heads, 0.0)
    r = to_tp // from_tp
    for rank in range(to_tp):
        src = rank // r
        # the sender's shard: its heads (one replicated head when kv_heads < from_tp)
        per_src = max(1, kv_heads // from_tp)
        first = src * kv_heads // from_tp if kv_heads < from_tp else src * per_src
        keys = [t[:, first : first + per_src] for t in full["layer_blocks"]["key_cache"]]
        values = [t[:, first : first + per_src] for t in full["layer_blocks"]["value_cache"]]
        shard = make_payload(keys, values, {})
        if kv_heads // from_tp < r:  # the spec's default: a head count that does not divide is kept whole
            assert torch.equal(slice_for_rank(shard, from_tp, to_tp, rank)["layer_blocks"]["key_cache"][0], keys[0])
        out = slice_for_rank(shard, from_tp, to_tp, rank, replicated_heads=True)  # the mapping declares num_kv_heads
        head = rank * kv_heads // to_tp
        for i in range(2):
            assert torch.equal(out["layer_blocks"]["key_cache"][i], full["layer_blocks"]["key_cache"][i][:, head : head + 1])
            assert torch.equal(out["layer_blocks"]["value_cache"][i], full["layer_blocks"]["value_cache"][i][:, head : head + 1])
        assert out["metadata"]["sliced_for_local_rank"] == rank


def test_slice_missing_layer_and_noop_cases() -> None:
    out = slice_for_rank(_payload(4, 0.0, missing=(0,)), 1, 2, 0)
    assert out["layer_blocks"]["key_cache"][0] is None
    assert out["layer_blocks"]["key_cache"][1].shape == (5, 2, 4)
    same = slice_for_rank(_payload(4, 0.0), 2, 1, 0)
    assert same["layer_blocks"]["key_cache"][0].shape == (5, 4, 4)
    assert "sliced_for_local_rank" not in same["metadata"]
    with pytest.raises(ConfigError):
        slice_for_rank(_payload(4, 0.0), 1, 2, 2)
