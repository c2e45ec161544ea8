"""KVTransferManager over the in-process ``memory`` connector: all ranks of both stages in one process."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import omni_plugins
from omni_plugins import RankMapping
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.errors import ConfigError, ConnectorClosedError, ConnectorError
from omni_plugins.kv import KVLayoutError, KVPayloadError, KVTransferManager
from omni_plugins.kv import manager as manager_mod
from omni_plugins.kv.testing import build_paged_caches, full_kv, head_range, shard_kv
from omni_plugins.memory import MemoryConnector

BLOCK = 4
LAYERS = 3
MISSING = (1,)


def _conn(ns: str) -> MemoryConnector:
    conn = omni_plugins.create_connector("memory", {"namespace": ns})
    assert isinstance(conn, MemoryConnector)
    return conn


def _sender(conn: Connector | None, from_tp: int, to_tp: int, rank: int, **kw: Any) -> KVTransferManager:
    kw.setdefault("layout", "nhd")  # heads per rank may equal BLOCK, which "auto" rejects as ambiguous
    return KVTransferManager(
        conn, stage_id=0, from_stage=0, to_stage=1, rank_mapping=RankMapping(from_tp=from_tp, to_tp=to_tp), local_rank=rank, **kw
    )


def _receiver(conn: Connector | None, from_tp: int, to_tp: int, rank: int, **kw: Any) -> KVTransferManager:
    return KVTransferManager(
        conn, stage_id=1, from_stage=0, to_stage=2, rank_mapping=RankMapping(from_tp=from_tp, to_tp=to_tp), local_rank=rank, **kw
    )


def _full(rid: str, heads: int, seq_len: int = 10) -> Any:
    return full_kv(rid, num_layers=LAYERS, seq_len=seq_len, num_heads=heads, head_dim=2, missing_layers=MISSING)


def _send(mgr: KVTransferManager, full: dict[str, Any], heads: int, **kw: Any) -> list[str]:
    """Send this sender rank's head shard of each request, with internal ids ``int-<rid>``."""
    shard = head_range(heads, mgr.from_tp, mgr.local_rank)
    entries = {rid: shard_kv(kv, shard) for rid, kv in full.items()}
    caches, finished = build_paged_caches(entries, block_size=BLOCK, seed=mgr.local_rank)
    finished = {f"int-{rid}": {**info, "custom_metadata": {"speaker": "a", "seq_len": -1}} for rid, info in finished.items()}
    return mgr.handle_finished_requests_kv_transfer(finished, caches, BLOCK, "auto", request_id_resolver=lambda i: i[4:], **kw)


def _assert_heads(payload: dict, full: Any, heads: slice) -> None:
    want_k, want_v = shard_kv(full, heads)
    got_k, got_v = payload["layer_blocks"]["key_cache"], payload["layer_blocks"]["value_cache"]
    assert len(got_k) == len(got_v) == LAYERS
    for layer in range(LAYERS):
        if layer in MISSING:
            assert got_k[layer] is None and got_v[layer] is None
        else:
            assert torch.equal(got_k[layer], want_k[layer]), f"layer {layer} keys"
            assert torch.equal(got_v[layer], want_v[layer]), f"layer {layer} values"


TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (2, 2), (4, 1), (1, 4)]


@pytest.mark.parametrize(("from_tp", "to_tp"), TOPOLOGIES)
def test_round_trip_every_topology(memory_namespace: str, from_tp: int, to_tp: int) -> None:
    heads = 8
    full = {rid: _full(rid, heads, seq_len) for rid, seq_len in (("a", 10), ("b", 3))}
    senders = [_sender(_conn(memory_namespace), from_tp, to_tp, i) for i in range(from_tp)]
    receivers = [_receiver(_conn(memory_namespace), from_tp, to_tp, j) for j in range(to_tp)]
    store = receivers[0].connector
    assert isinstance(store, MemoryConnector)
    for s in senders:
        assert _send(s, full, heads) == ["int-a", "int-b"]
        assert s.drain_failed_sends() == []
    per_sender = max(1, to_tp // from_tp)
    assert len(store.keys()) == 2 * from_tp * per_sender
    assert store.keys() == sorted(k for s in senders for rid in full for k in s.send_keys(rid))
    for j, r in enumerate(receivers):
        for rid in full:
            payload, size = r.receive_kv_cache_for_request(rid, timeout_s=5)
            assert payload is not None and size > 0
            _assert_heads(payload, full[rid], head_range(heads, to_tp, j))
            meta = payload["metadata"]
            assert meta["request_id"] == rid and meta["from_stage"] == 0
            assert meta["seq_len"] == full[rid][0][0].shape[0]  # routing fields win over custom metadata
            assert meta["speaker"] == "a"
            if from_tp > to_tp:
                assert meta["merged_remote_rank_count"] == from_tp // to_tp
            else:
                assert "merged_remote_rank_count" not in meta
            if from_tp < to_tp:
                assert meta["sliced_for_local_rank"] == j
            else:
                assert "sliced_for_local_rank" not in meta
    assert store.keys() == []
    for m in senders + receivers:
        m.cleanup("int-a", drop_sent=False)
        m.cleanup("b", drop_sent=False)  # external id works too
        assert m.tracked_request_ids() == []
        m.close()
        m.connector.close()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("from_tp", "to_tp", "kv_heads"), [(4, 1, 2), (4, 2, 2), (2, 1, 1), (4, 2, 1), (8, 2, 2), (8, 1, 2), (1, 4, 2), (2, 4, 1), (2, 8, 2)]
)
def test_replicated_kv_heads_are_merged_once(memory_namespace: str, from_tp: int, to_tp: int, kv_heads: int) -> None:
    """GQA with fewer KV heads than TP ranks, declared by ``num_kv_heads``: sender rank s holds a copy of head
    s // (from_tp // kv_heads); a receiver merges one copy of each head (it got every copy before) and a receiver
    with more ranks than heads keeps the one head replicated on it."""
    mapping = RankMapping(from_tp=from_tp, to_tp=to_tp, num_kv_heads=kv_heads)
    replicas = mapping.head_replicas
    full = {"a": _full("a", kv_heads)}
    store = _conn(memory_namespace)
    for s in range(from_tp):
        sender = KVTransferManager(store, stage_id=0, from_stage=0, to_stage=1, rank_mapping=mapping, local_rank=s, layout="nhd")
        heads = slice(s // replicas, s // replicas + 1) if kv_heads < from_tp else head_range(kv_heads, from_tp, s)
        entries = {rid: shard_kv(kv, heads) for rid, kv in full.items()}
        caches, finished = build_paged_caches(entries, block_size=BLOCK, seed=s)
        assert sender.handle_finished_requests_kv_transfer(finished, caches, BLOCK, "auto") == ["a"]
    for j in range(to_tp):
        receiver = KVTransferManager(store, stage_id=1, from_stage=0, to_stage=2, rank_mapping=mapping, local_rank=j)
        payload, _ = receiver.receive_kv_cache_for_request("a", timeout_s=5)
        assert payload is not None
        want = head_range(kv_heads, to_tp, j) if to_tp <= kv_heads else slice(j * kv_heads // to_tp, j * kv_heads // to_tp + 1)
        _assert_heads(payload, full["a"], want)
    assert store.keys() == []  # the copies that were not merged were taken from the connector all the same


def test_num_kv_heads_must_divide_the_sender_tp() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        RankMapping(from_tp=4, to_tp=1, num_kv_heads=3)
    assert RankMapping(from_tp=2, to_tp=1, num_kv_heads=8).head_replicas == 1  # more heads than ranks: nothing replicated
    assert RankMapping(from_tp=8, to_tp=2, num_kv_heads=2).head_replicas == 4


def test_non_divisible_heads_kept_whole(memory_namespace: str) -> None:
    full = {"a": _full("a", 3)}
    sender = _sender(_conn(memory_namespace), 1, 2, 0)
    _send(sender, full, 3)
    for j in range(2):
        payload, _ = _receiver(_conn(memory_namespace), 1, 2, j).receive_kv_cache_for_request("a", timeout_s=5)
        assert payload is not None
        _assert_heads(payload, full["a"], slice(0, 3))
        assert "sliced_for_local_rank" not in payload["metadata"]


def test_receive_timeout_returns_none_and_leaves_nothing(memory_connector: MemoryConnector) -> None:
    r = _receiver(memory_connector, 1, 1, 0)
    assert r.receive_kv_cache_for_request("nobody", timeout_s=0.2) == (None, 0)
    assert r.tracked_request_ids() == []
    assert memory_connector.keys() == []


def test_partial_shards_dropped_on_timeout_and_late_ones_cleaned(memory_namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    full = {"a": _full("a", 4)}
    s0, s1 = (_sender(_conn(memory_namespace), 2, 1, i) for i in range(2))
    r = _receiver(_conn(memory_namespace), 2, 1, 0, recv_timeout_s=0.2)
    _send(s0, full, 4)
    with caplog.at_level(logging.WARNING):
        assert r.receive_kv_cache_for_request("a") == (None, 0)
    assert "dropping" in caplog.text
    store = r.connector
    assert isinstance(store, MemoryConnector)
    assert store.keys() == []  # s0's shard was consumed and dropped
    assert r.tracked_request_ids() == []
    _send(s1, full, 4)  # arrives after the receiver gave up
    assert len(store.keys()) == 1
    assert r.cleanup("a") == 1
    assert store.keys() == []


def test_keep_partial_completes_on_a_later_call(memory_namespace: str) -> None:
    full = {"a": _full("a", 4)}
    s0, s1 = (_sender(_conn(memory_namespace), 2, 1, i) for i in range(2))
    r = _receiver(_conn(memory_namespace), 2, 1, 0)
    _send(s0, full, 4)
    assert r.receive_kv_cache_for_request("a", timeout_s=0, keep_partial=True) == (None, 0)
    assert r.tracked_request_ids() == ["a"]
    _send(s1, full, 4)
    payload, size = r.receive_kv_cache_for_request("a", timeout_s=0, keep_partial=True)
    assert payload is not None and size > 0
    _assert_heads(payload, full["a"], slice(0, 4))
    assert payload["metadata"]["merged_remote_rank_count"] == 2
    assert r.tracked_request_ids() == []


def test_keep_partial_shards_freed_by_cleanup(memory_namespace: str) -> None:
    s0 = _sender(_conn(memory_namespace), 2, 1, 0)
    r = _receiver(_conn(memory_namespace), 2, 1, 0)
    _send(s0, {"a": _full("a", 4)}, 4)
    assert r.receive_kv_cache_for_request("a", timeout_s=0, keep_partial=True) == (None, 0)
    r.cleanup("a")
    assert r.tracked_request_ids() == []
    assert r.connector.keys() == []  # type: ignore[union-attr]


def test_blocking_receive_waits_for_a_late_sender(memory_namespace: str) -> None:
    r = _receiver(_conn(memory_namespace), 1, 1, 0)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(r.receive_kv_cache_for_request("a", timeout_s=30)))
    t.start()
    full = {"a": _full("a", 2)}
    _send(_sender(_conn(memory_namespace), 1, 1, 0), full, 2)
    t.join(timeout=30)
    assert not t.is_alive()
    payload, _ = result[0]
    _assert_heads(payload, full["a"], slice(0, 2))


def test_sender_cleanup_removes_unconsumed_shards(memory_connector: MemoryConnector) -> None:
    s = _sender(memory_connector, 1, 2, 0)
    _send(s, {"a": _full("a", 4), "b": _full("b", 4)}, 4)
    assert len(memory_connector.keys()) == 4
    assert s.tracked_request_ids() == ["int-a", "int-b"]
    assert s.cleanup("int-a") == 2
    assert s.cleanup("b") == 2  # by external id
    assert memory_connector.keys() == []
    assert s.tracked_request_ids() == []
    assert s.cleanup("a") == 0  # idempotent


def test_close_frees_everything_and_is_final(memory_connector: MemoryConnector) -> None:
    s = _sender(memory_connector, 1, 1, 0)
    _send(s, {"a": _full("a", 2)}, 2)
    s.close()
    s.close()
    assert memory_connector.keys() == []
    assert s.tracked_request_ids() == []
    with pytest.raises(ConnectorClosedError):
        s.receive_kv_cache_for_request("a")
    with pytest.raises(ConnectorClosedError):
        _send(s, {"a": _full("a", 2)}, 2)
    assert not memory_connector.closed  # the connector belongs to the caller


def test_cfg_companions(memory_namespace: str) -> None:
    full = {rid: _full(rid, 2) for rid in ("main", "main__cfg_text", "main__cfg_img")}
    _send(_sender(_conn(memory_namespace), 1, 1, 0), full, 2)
    r = _receiver(_conn(memory_namespace), 1, 1, 0)
    got = r.receive_cfg_companion({"cfg_text": "main__cfg_text", "cfg_img": "main__cfg_img", "cfg_none": "absent"}, timeout_s=0.3)
    assert set(got) == {"cfg_text", "cfg_img", "cfg_none"}
    assert got["cfg_none"] == (None, 0)
    for role, rid in (("cfg_text", "main__cfg_text"), ("cfg_img", "main__cfg_img")):
        payload, size = got[role]
        assert payload is not None and size > 0
        _assert_heads(payload, full[rid], slice(0, 2))
    main, _ = r.receive_kv_cache_for_request("main", timeout_s=1)
    assert main is not None
    assert r.connector.keys() == []  # type: ignore[union-attr]


def test_apply_kv_cache_to_request(memory_namespace: str) -> None:
    full = {"a": _full("a", 2)}
    _send(_sender(_conn(memory_namespace), 1, 1, 0), full, 2)
    r = _receiver(_conn(memory_namespace), 1, 1, 0)
    payload, _ = r.receive_kv_cache_for_request("a", target_device="meta", timeout_s=5)
    assert payload is not None
    assert payload["layer_blocks"]["key_cache"][0].device.type == "meta"
    req = SimpleNamespace(request_id="a", sampling_params=SimpleNamespace())
    r.apply_kv_cache_to_request(req, payload)
    assert all(a is b for a, b in zip(req.past_key_values.key_cache, payload["layer_blocks"]["key_cache"], strict=True))
    assert len(req.past_key_values.value_cache) == LAYERS
    assert req.kv_metadata["request_id"] == "a"
    assert req.sampling_params.past_key_values is req.past_key_values
    assert req.kv_payload["metadata"] == req.kv_metadata
    with pytest.raises(KVPayloadError):
        r.apply_kv_cache_to_request(SimpleNamespace(), {"layer_blocks": "nope"})


def test_malformed_shard_is_rejected_and_freed(memory_connector: MemoryConnector, caplog: pytest.LogCaptureFixture) -> None:
    r = _receiver(memory_connector, 1, 1, 0)
    memory_connector.put(0, 1, r.recv_keys("a")[0], {"layer_blocks": {"key_cache": [torch.zeros(3)], "value_cache": [None]}})
    with caplog.at_level(logging.ERROR):
        assert r.receive_kv_cache_for_request("a", timeout_s=1) == (None, 0)
    assert ">= 2 dims" in caplog.text
    assert memory_connector.keys() == []


def test_bad_request_in_a_batch_does_not_block_the_others(memory_connector: MemoryConnector) -> None:
    s = _sender(memory_connector, 1, 1, 0)
    entries = {"a": shard_kv(_full("a", 2), slice(0, 2))}
    caches, finished = build_paged_caches(entries, block_size=BLOCK)
    finished["bad"] = {"seq_len": 10, "block_ids": [999, 1000, 1001]}
    finished["noblocks"] = {"seq_len": 10}
    done = s.handle_finished_requests_kv_transfer(finished, caches, BLOCK, "auto")
    assert done == ["a", "bad", "noblocks"]  # all done: the caller may free their blocks
    assert s.drain_failed_sends() == ["bad", "noblocks"]
    assert s.drain_failed_sends() == []
    assert memory_connector.keys() == s.send_keys("a")
    assert s.tracked_request_ids() == ["a"]
    s.close()


def test_unreadable_caches_raise_before_sending(memory_connector: MemoryConnector) -> None:
    s = _sender(memory_connector, 1, 1, 0)
    with pytest.raises(KVLayoutError):
        s.handle_finished_requests_kv_transfer({"a": {"seq_len": 1, "block_ids": [0]}}, [torch.zeros(4, 4)], BLOCK, "auto")
    assert memory_connector.keys() == []


class _Flaky(Connector):
    """Fault injection: a memory connector whose puts fail for chosen keys (``fail_for`` attempts)."""

    capabilities = Capabilities(blocking_get=True)

    def __init__(self, inner: MemoryConnector, fail: dict[str, int]) -> None:
        super().__init__()
        self.inner, self.fail = inner, fail

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        for suffix, left in self.fail.items():
            if key.endswith(suffix) and left > 0:
                self.fail[suffix] = left - 1
                if left % 2:
                    raise ConnectorError(f"injected failure for {key}")
                return PutResult(False, 0, {"error": "injected"})
        return self.inner.put(from_stage, to_stage, key, data)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        return self.inner.get(from_stage, to_stage, key, timeout=timeout)

    def _cleanup(self, key: str) -> bool:
        return self.inner.cleanup(key)


def test_put_retries_then_succeeds(memory_connector: MemoryConnector, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_mod, "_PUT_BACKOFF_S", 0.0)
    s = _sender(_Flaky(memory_connector, {"_0_1": 2}), 1, 2, 0, put_attempts=3)
    assert _send(s, {"a": _full("a", 4)}, 4) == ["int-a"]
    assert s.drain_failed_sends() == []
    assert len(memory_connector.keys()) == 2


def test_failed_put_leaves_no_partial_shards(memory_connector: MemoryConnector, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_mod, "_PUT_BACKOFF_S", 0.0)
    s = _sender(_Flaky(memory_connector, {"_0_1": 5}), 1, 2, 0, put_attempts=3)
    assert _send(s, {"a": _full("a", 4)}, 4) == ["int-a"]
    assert s.drain_failed_sends() == ["int-a"]
    assert memory_connector.keys() == []  # the shard for target 0 was withdrawn
    assert s.tracked_request_ids() == []


class _NonConsuming(Connector):
    """A connector whose ``get`` does not consume (``consume_on_get=False``)."""

    capabilities = Capabilities(blocking_get=False, consume_on_get=False)

    def __init__(self) -> None:
        super().__init__()
        self.items: dict[str, Any] = {}

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        self.items[key] = data
        return PutResult(True, 1)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        return GetResult(self.items[key], 1) if key in self.items else None

    def _cleanup(self, key: str) -> bool:
        return self.items.pop(key, None) is not None


def test_non_consuming_connector_is_cleaned_after_receive() -> None:
    conn = _NonConsuming()
    full = {"a": _full("a", 4)}
    for i in range(2):
        _send(_sender(conn, 2, 1, i), full, 4)
    r = _receiver(conn, 2, 1, 0)
    payload, size = r.receive_kv_cache_for_request("a", timeout_s=0)
    assert payload is not None and size == 2
    assert conn.items == {}
    # and a partial receive that times out frees the shard it read
    _send(_sender(conn, 2, 1, 0), full, 4)
    assert r.receive_kv_cache_for_request("a", timeout_s=0) == (None, 0)
    assert conn.items == {}


def test_no_connector_is_a_noop() -> None:
    s = _sender(None, 1, 1, 0)
    assert s.handle_finished_requests_kv_transfer({"a": {}}, [], BLOCK, "auto") == ["a"]
    assert _receiver(None, 1, 1, 0).receive_kv_cache_for_request("a") == (None, 0)
    assert s.cleanup("a") == 0


def test_constructor_validation(memory_connector: MemoryConnector) -> None:
    with pytest.raises(ConfigError, match="rank_mapping"):
        KVTransferManager(memory_connector, stage_id=0, from_stage=0, to_stage=1, rank_mapping={"from_tp": 3, "to_tp": 2})
    with pytest.raises(ConfigError, match="out of range"):
        KVTransferManager(memory_connector, stage_id=0, from_stage=0, to_stage=1, rank_mapping=RankMapping(from_tp=2), local_rank=2)
    with pytest.raises(ConfigError, match="recv_timeout_s"):
        KVTransferManager(memory_connector, stage_id=0, from_stage=0, to_stage=1, rank_mapping=RankMapping(), recv_timeout_s=-1)
    with pytest.raises(ConfigError, match="layout"):
        KVTransferManager(memory_connector, stage_id=0, from_stage=0, to_stage=1, rank_mapping=RankMapping(), layout="x")  # type: ignore[arg-type]
    m = KVTransferManager(memory_connector, stage_id=0, from_stage=0, to_stage=1, rank_mapping={"from_tp": 1, "to_tp": 2}, local_rank=1)
    with pytest.raises(ConfigError, match="from_tp"):  # rank 1 of the receiving side cannot send
        m.handle_finished_requests_kv_transfer({"a": {}}, [], BLOCK, "auto")


def test_resolver_failure_fails_only_that_request(memory_connector: MemoryConnector) -> None:
    s = _sender(memory_connector, 1, 1, 0)
    entries = {rid: shard_kv(_full(rid, 2), slice(0, 2)) for rid in ("a", "b")}
    caches, finished = build_paged_caches(entries, block_size=BLOCK)

    def resolver(rid: str) -> str:
        if rid == "a":
            raise KeyError(rid)
        return f"ext-{rid}"

    assert s.handle_finished_requests_kv_transfer(finished, caches, BLOCK, "auto", request_id_resolver=resolver) == ["a", "b"]
    assert s.drain_failed_sends() == ["a"]
    assert memory_connector.keys() == s.send_keys("ext-b")
    s.close()


class _Buggy(_NonConsuming):
    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        raise OSError("plugin bug")


def test_plugin_bug_in_get_gives_none(caplog: pytest.LogCaptureFixture) -> None:
    r = _receiver(_Buggy(), 1, 1, 0)
    with caplog.at_level(logging.ERROR):
        assert r.receive_kv_cache_for_request("a", timeout_s=0) == (None, 0)
    assert "plugin bug" in caplog.text


class _FlakyGet(_Flaky):
    """Fault injection: :class:`_Flaky` (no failing puts) whose gets of keys ending in ``suffix`` raise ``error`` ``fails`` times."""

    def __init__(self, inner: MemoryConnector, suffix: str, fails: int, error: Exception) -> None:
        super().__init__(inner, {})
        self.suffix, self.fails, self.error = suffix, fails, error
        self.attempts = 0

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        if key.endswith(self.suffix):
            self.attempts += 1
            if self.fails > 0:
                self.fails -= 1
                raise self.error
        return super()._get(from_stage, to_stage, key, timeout)


def _two_shards_sent(ns: str) -> dict[str, Any]:
    full = {"a": _full("a", 4)}
    for i in range(2):
        _send(_sender(_conn(ns), 2, 1, i), full, 4)
    return full


def test_failed_reads_are_retried_and_lose_no_shard(memory_namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails (Mooncake's -703 while a segment is set up) is retried; the shard read before it is kept."""
    monkeypatch.setattr(manager_mod, "_GET_BACKOFF_S", 0.0)
    full = _two_shards_sent(memory_namespace)
    store = _conn(memory_namespace)
    flaky = _FlakyGet(store, "_0_1_0", fails=3, error=ConnectorError("injected read failure"))  # source rank 1's shard
    payload, size = _receiver(flaky, 2, 1, 0).receive_kv_cache_for_request("a", timeout_s=30)
    assert payload is not None and size > 0
    assert payload["metadata"]["merged_remote_rank_count"] == 2
    _assert_heads(payload, full["a"], slice(0, 4))
    assert flaky.attempts == 4
    assert store.keys() == []


def test_reads_failing_past_the_deadline_keep_partial_shards(memory_namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_mod, "_GET_BACKOFF_S", 0.0)
    full = _two_shards_sent(memory_namespace)
    store = _conn(memory_namespace)
    flaky = _FlakyGet(store, "_0_1_0", fails=10**9, error=ConnectorError("injected read failure"))
    r = _receiver(flaky, 2, 1, 0)
    assert r.receive_kv_cache_for_request("a", timeout_s=0.05, keep_partial=True) == (None, 0)
    assert flaky.attempts >= 1
    assert r.tracked_request_ids() == ["a"]  # rank 0's shard, consumed from the backend, is held here
    assert len(store.keys()) == 1  # rank 1's shard is still in the backend
    flaky.fails = 0
    payload, _ = r.receive_kv_cache_for_request("a", timeout_s=0, keep_partial=True)
    assert payload is not None
    _assert_heads(payload, full["a"], slice(0, 4))
    assert r.tracked_request_ids() == [] and store.keys() == []


def test_closed_connector_is_not_retried(memory_namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    _two_shards_sent(memory_namespace)
    flaky = _FlakyGet(_conn(memory_namespace), "_0_0_0", fails=10**9, error=ConnectorClosedError("closed under us"))
    with caplog.at_level(logging.ERROR):
        assert _receiver(flaky, 2, 1, 0).receive_kv_cache_for_request("a", timeout_s=30) == (None, 0)
    assert flaky.attempts == 1
    assert "closed under us" in caplog.text


@pytest.mark.parametrize(
    "lie",
    [{"request_id": "other"}, {"from_rank": 0}, {"from_tp": 4}, {"to_tp": 2}, {"seq_len": 9}, {"num_layers": 2}],
    ids=["wrong-request", "wrong-rank", "wrong-from-tp", "wrong-to-tp", "wrong-seq-len", "wrong-num-layers"],
)
def test_shard_whose_metadata_contradicts_its_key_is_rejected(
    memory_connector: MemoryConnector, caplog: pytest.LogCaptureFixture, lie: dict[str, Any]
) -> None:
    """Shard 1 of a 2 -> 1 merge claims another request / rank / mapping: merging it would put foreign heads in place."""
    r = _receiver(memory_connector, 2, 1, 0)
    keys = r.recv_keys("a")
    honest = {"request_id": "a", "from_tp": 2, "to_tp": 1, "seq_len": 5, "num_layers": 1}
    for src, key in enumerate(keys):
        meta = {**honest, "from_rank": src, **(lie if src == 1 else {})}
        memory_connector.put(
            0, 1, key, {"layer_blocks": {"key_cache": [torch.zeros(5, 2, 3)], "value_cache": [torch.zeros(5, 2, 3)]}, "metadata": meta}
        )
    with caplog.at_level(logging.ERROR):
        assert r.receive_kv_cache_for_request("a", timeout_s=1) == (None, 0)
    assert "metadata" in caplog.text
    assert memory_connector.keys() == [] and r.tracked_request_ids() == []
