"""KV: delegation to the KV manager, lifecycle, rank routing, merge and slice."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rt_helpers import Req

from omni_plugins import ConfigError, StageConfig
from omni_plugins.kv.testing import build_paged_caches, full_kv
from omni_plugins.runtime import StageTransferRuntime


class FakeKV:
    """Records calls; stands in for the KV manager where only delegation is tested."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.store: dict[str, dict[str, Any]] = {}

    def handle_finished_requests_kv_transfer(self, finished_reqs, kv_caches, block_size, cache_dtype, request_id_resolver=None):
        self.calls.append(("send", dict(finished_reqs)))
        return [r for r in finished_reqs if r != "broken"]

    def drain_failed_sends(self) -> list[str]:
        return ["broken"] if any(c[0] == "send" and "broken" in c[1] for c in self.calls) else []

    def receive_kv_cache_for_request(self, request_id: str, target_device: Any = None) -> tuple[dict[str, Any] | None, int]:
        self.calls.append(("recv", request_id))
        data = self.store.get(request_id)
        return (data, 10) if data else (None, 0)

    @staticmethod
    def apply_kv_cache_to_request(req: Any, data: dict[str, Any]) -> None:
        req.kv = data

    def cleanup(self, request_id: str, *, drop_sent: bool = True) -> int:
        self.calls.append(("cleanup", (request_id, drop_sent)))
        return 0

    def close(self) -> None:
        self.calls.append(("close", None))


def _rt(kv: Any, **stage: Any) -> StageTransferRuntime:
    return StageTransferRuntime(StageConfig(stage_id=1, **stage), kv_manager=kv)


def test_send_kv_cache_records_kv_sent_and_failures() -> None:
    kv = FakeKV()
    rt = _rt(kv)
    sent = rt.send_kv_cache({"a": {"seq_len": 1, "block_ids": [0]}, "broken": {}}, [], 16, "float32")
    assert sent == ["a"]
    sig = rt.collect_signals()
    assert sig.kv_sent == ["a"] and sig.failed == {"broken"}
    assert rt.collect_signals().kv_sent == []
    rt.shutdown()


def test_without_manager_send_returns_ids_and_recv_nothing() -> None:
    rt = _rt(None)
    assert rt.send_kv_cache({"a": {}, "b": {}}, [], 16, "float32") == ["a", "b"]
    assert rt.recv_kv_cache("a") == (None, 0)
    assert rt.receive_multi_kv_cache(Req("a")) is False
    rt.shutdown()


def test_receive_multi_with_cfg_companions() -> None:
    kv = FakeKV()
    kv.store = {"main": {"k": 1}, "neg": {"k": 2}}
    rt = _rt(kv)
    req = Req("main", sampling_params=SimpleNamespace(cfg_kv_request_ids={"negative": "neg", "missing": "nope"}))
    collected: dict[str, Any] = {}

    def collect(rid: str, payloads: dict[str, Any]) -> dict[str, Any]:
        collected.update(payloads)
        return {"cfg_negative": payloads["negative"][0]}

    assert rt.receive_multi_kv_cache(req, collect) is True
    assert req.kv == {"k": 1}
    assert collected == {"negative": ({"k": 2}, 10), "missing": (None, 0)}
    assert req.sampling_params.cfg_negative == {"k": 2}
    assert rt.receive_cfg_companion_kv_payloads({"x": "neg"}) == {"x": ({"k": 2}, 10)}
    assert rt.receive_multi_kv_cache(Req("main"), active_request_ids={"other"}) is False  # inactive
    rt.shutdown()


def collect_like_vllm_omni(request_id: str, cfg_request_ids: dict[str, str], kv_transfer_manager: Any, target_device: Any = None) -> dict[str, Any]:
    """vLLM-Omni's form of a CFG collect function (BAGEL's collect_cfg_kv_caches): it fetches each companion itself."""
    out: dict[str, Any] = {}
    for role, rid in cfg_request_ids.items():
        data, _ = kv_transfer_manager.receive_kv_cache_for_request(rid, target_device)
        if data:
            out[f"{role}_past_key_values"] = data
    return out


def test_the_stage_cfg_kv_collect_func_is_used_in_vllm_omni_form() -> None:
    """A stage's cfg_kv_collect_func (as a vLLM-Omni file names BAGEL's) collects the companions when the caller gives none."""
    kv = FakeKV()
    kv.store = {"main": {"k": 1}, "main__cfg_text": {"k": 2}}
    rt = _rt(kv, cfg_kv_collect_func=f"{__name__}.collect_like_vllm_omni")
    req = Req("main", sampling_params=SimpleNamespace(cfg_kv_request_ids={"cfg_text": "main__cfg_text", "cfg_img": "gone"}))
    assert rt.receive_multi_kv_cache(req) is True
    assert req.sampling_params.cfg_text_past_key_values == {"k": 2} and not hasattr(req.sampling_params, "cfg_img_past_key_values")
    assert ("recv", "main__cfg_text") in kv.calls and ("recv", "gone") in kv.calls
    rt.shutdown()
    with pytest.raises(ConfigError, match=r"stage 1: cfg_kv_collect_func: 'os\.nothing_here' cannot be imported"):
        _rt(FakeKV(), cfg_kv_collect_func="os.nothing_here")


def test_kv_lifecycle_pending_active_completed_with_dedup() -> None:
    rt = _rt(FakeKV())
    assert not rt.has_pending_kv_work()
    assert rt.mark_kv_transfer("r", 10, [1, 2], {"role": "x"}) is True
    assert rt.mark_kv_transfer("r", 99, [9]) is False  # dedup while pending
    assert rt.is_kv_transfer_triggered("r") and rt.has_pending_kv_work()
    assert rt.collect_signals().has_pending_kv_work
    assert rt.drain_pending_kv_transfers() == {"r": {"seq_len": 10, "block_ids": [1, 2], "custom_metadata": {"role": "x"}}}
    assert rt.drain_pending_kv_transfers() == {}
    assert rt.mark_kv_transfer("r", 99, [9]) is False  # dedup while active
    assert rt.has_pending_kv_work()
    rt.ack_kv_transfers(["r"])
    assert rt.has_pending_kv_work()  # completed, not yet drained
    assert rt.drain_completed_kv_transfers() == {"r"}
    assert rt.drain_completed_kv_transfers() == set()
    assert not rt.has_pending_kv_work() and rt.is_kv_transfer_triggered("r")
    rt.cleanup_finished_request("r")
    assert not rt.is_kv_transfer_triggered("r") and rt.active_request_count() == 0
    rt.shutdown()


def test_cleanup_delegates_to_kv_manager() -> None:
    kv = FakeKV()
    rt = _rt(kv)
    rt.mark_kv_transfer("r", 1, [0])
    rt.cleanup_finished_request("r")
    rt.cleanup_finished_request("s", aborted=True)
    assert ("cleanup", ("r", False)) in kv.calls and ("cleanup", ("s", True)) in kv.calls
    rt.shutdown()


@pytest.mark.parametrize(
    ("from_tp", "to_tp", "local", "recv_from", "send_to"),
    [
        (1, 1, 0, [0], [0]),
        (2, 1, 0, [0, 1], [0]),  # receiver rank 0 of TP=1 merges two shards
        (2, 1, 1, None, [0]),  # sender rank 1 of TP=2 sends to rank 0
        (1, 2, 1, [0], None),  # receiver rank 1 of TP=2 reads sender 0
        (1, 2, 0, [0], [0, 1]),
        (4, 2, 1, [2, 3], [0]),
        (4, 2, 3, None, [1]),
    ],
)
def test_rank_routing(from_tp: int, to_tp: int, local: int, recv_from: list[int] | None, send_to: list[int] | None) -> None:
    rt = StageTransferRuntime(StageConfig(stage_id=1, rank_mapping={"from_tp": from_tp, "to_tp": to_tp}), local_rank=local)
    if recv_from is None:
        with pytest.raises(ConfigError):
            rt.get_kv_remote_ranks()
    else:
        assert rt.get_kv_remote_ranks() == recv_from
        assert rt.get_rank_aware_kv_keys("req", 0) == [f"req_0_0_{r}_{local}" for r in recv_from]
    if send_to is None:
        with pytest.raises(ConfigError):
            rt.get_kv_target_ranks_for_send()
    else:
        assert rt.get_kv_target_ranks_for_send() == send_to
        assert rt.get_rank_aware_kv_send_keys("req", 1, chunk_id=2) == [f"req_1_2_{local}_{t}" for t in send_to]
    assert rt.get_kv_connector_key("q", 3, 4, 5, 6) == "q_3_4_5_6"
    rt.shutdown()


def test_rank_mapping_from_connector_config(namespace: str) -> None:
    rt = StageTransferRuntime(
        StageConfig(stage_id=1),
        {"name": "memory", "extra": {"namespace": namespace}, "rank_mapping": {"from_tp": 4, "to_tp": 2}},
        local_rank=1,
    )
    assert rt.get_kv_remote_ranks() == [2, 3]
    assert rt.get_kv_rank_mapping() == {"from_tp": 4, "to_tp": 2, "local_rank": 1, "is_data_transfer_rank": True}
    rt.shutdown()


def _layer(heads: int, fill: float) -> torch.Tensor:
    return torch.full((3, heads, 2), fill)


def test_merge_and_slice_through_runtime() -> None:
    rt = StageTransferRuntime(StageConfig(stage_id=1, rank_mapping={"from_tp": 2, "to_tp": 1}), local_rank=0)
    shards = [
        {"layer_blocks": {"key_cache": [_layer(2, r), None], "value_cache": [_layer(2, r + 10), None]}, "metadata": {"from_rank": r}}
        for r in range(2)
    ]
    merged = rt.merge_rank_sharded_kv_payloads(shards)
    assert merged is not None
    k = merged["layer_blocks"]["key_cache"][0]
    assert k.shape == (3, 4, 2) and k[0, :, 0].tolist() == [0, 0, 1, 1]
    assert merged["layer_blocks"]["key_cache"][1] is None
    assert merged["metadata"]["merged_remote_rank_count"] == 2
    assert rt.merge_rank_sharded_kv_payloads([]) is None
    rt.shutdown()

    rt2 = StageTransferRuntime(StageConfig(stage_id=1, rank_mapping={"from_tp": 1, "to_tp": 2}), local_rank=1)
    layers = [torch.arange(12.0).reshape(1, 4, 3), torch.zeros(1, 3, 3)]
    full = {"layer_blocks": {"key_cache": layers, "value_cache": [t.clone() for t in layers]}, "metadata": {}}
    sliced = rt2.slice_rank_sharded_kv_payload(full)
    assert sliced is not None
    assert sliced["layer_blocks"]["key_cache"][0].shape == (1, 2, 3)
    assert sliced["layer_blocks"]["key_cache"][0][0, 0, 0] == 6.0  # heads 2..3
    assert sliced["layer_blocks"]["value_cache"][1].shape == (1, 3, 3)  # 3 heads do not divide by 2: kept whole
    assert sliced["metadata"]["sliced_for_local_rank"] == 1
    rt2.shutdown()


def test_real_kv_manager_round_trip(namespace: str) -> None:
    conn = {"name": "memory", "extra": {"namespace": namespace}}
    p = StageTransferRuntime(StageConfig(stage_id=0, kv_transfer=True), conn)
    c = StageTransferRuntime(StageConfig(stage_id=1, kv_transfer=True, recv_timeout_s=5), conn)
    try:
        assert p.kv_manager is not None and c.kv_manager is not None
        kv = full_kv("ext-r", num_layers=2, seq_len=5, num_heads=2, head_dim=4)
        caches, finished = build_paged_caches({"r": kv}, block_size=4)
        p.mark_kv_transfer("r", finished["r"]["seq_len"], finished["r"]["block_ids"])
        todo = p.drain_pending_kv_transfers()
        assert p.send_kv_cache(todo, caches, 4, "float32", request_id_resolver=lambda rid: "ext-r") == ["r"]
        p.ack_kv_transfers(["r"])
        assert p.collect_signals().kv_sent == ["r"]
        req = Req("ext-r")
        assert c.receive_multi_kv_cache(req) is True
        assert torch.equal(req.past_key_values.key_cache[0], kv[0][0])
        assert p.drain_completed_kv_transfers() == {"r"}
        p.cleanup_finished_request("r")
        c.cleanup_finished_request("ext-r")
        assert p.active_request_count() == 0 and c.active_request_count() == 0
        assert p.kv_manager.tracked_request_ids() == [] and c.kv_manager.tracked_request_ids() == []
        assert p.connector.keys() == []
    finally:
        p.shutdown()
        c.shutdown()


def test_cfg_companions_share_one_deadline(namespace: str) -> None:
    """Missing companions cost one receive timeout in total, not one per role (docs/runtime/kv.md)."""
    c = StageTransferRuntime(
        StageConfig(stage_id=1, kv_transfer=True, recv_timeout_s=0.2), {"name": "memory", "extra": {"namespace": namespace}}
    )
    try:
        assert c.connector is not None
        timeouts: list[float] = []
        real_get = c.connector.get

        def spy_get(from_stage: Any, to_stage: Any, key: str, timeout: float | None = None) -> Any:
            timeouts.append(0.0 if timeout is None else timeout)
            return real_get(from_stage, to_stage, key, timeout=timeout)

        c.connector.get = spy_get  # type: ignore[method-assign]
        out = c.receive_cfg_companion_kv_payloads({"neg": "n1", "uncond": "n2"})
        assert out == {"neg": (None, 0), "uncond": (None, 0)}
        assert len(timeouts) == 2 and timeouts[0] > 0 and timeouts[1] == 0.0  # the second role waits only for what is left
    finally:
        c.shutdown()
