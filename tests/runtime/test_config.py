"""Construction: connector config, to_stage, rank mapping, local rank, builder derivation, accumulation gate."""

from __future__ import annotations

import threading

import pytest
import torch
from rt_helpers import Req, make_runtime

from omni_plugins import ConfigError, PipelineConfig, StageConfig
from omni_plugins.errors import BuilderError
from omni_plugins.runtime import StageTransferRuntime


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("omni-")}


def test_no_connector_means_no_ops_and_no_threads() -> None:
    before = _threads()
    rt = StageTransferRuntime(StageConfig(stage_id=1, async_chunk=True, custom_process_next_stage_input_func="rt_builders.stream"))
    try:
        assert _threads() == before
        assert rt.connector is None
        assert rt.send_chunk(Req("a"), {"x": torch.ones(1)}) is False
        assert rt.send_full_payload_outputs({"a": {"x": 1}}) == []
        assert rt.register_chunk_recv(Req("a")) is False
        assert rt.recv_full_payload_inputs() == {} and rt.recv_chunk() == {}
        assert rt.accumulate_full_payload_output("a", {"x": torch.ones(1, 1)}, Req("a")) is False
        assert not rt.collect_signals()
        assert rt.active_request_count() == 0
    finally:
        rt.shutdown()
        rt.shutdown()  # idempotent


@pytest.mark.parametrize(
    ("cfg", "fragment"),
    [
        ({"name": "  "}, "blank"),
        ({"name": "memory", "extra": ["not", "a", "mapping"]}, "extra"),
        ({"extra": {}}, "name"),
        ({"name": "memory", "rank_mapping": {"from_tp": 3, "to_tp": 2}}, "divisible"),
        ({"name": "memory", "rank_mapping": {"from_tp": 0, "to_tp": 1}}, "from_tp"),
        ({"name": "memory", "to_stage": "two"}, "to_stage"),
        ({"name": "memory", "rank_mapping": {"from_tp": 1, "to_tp": 0}}, "to_tp"),
        (["memory"], "mapping"),  # not a mapping at all
    ],
)
def test_bad_connector_config_names_the_stage(cfg: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        StageTransferRuntime(StageConfig(stage_id=3), cfg)
    assert "stage 3" in str(err.value) and fragment in str(err.value)


def test_unknown_connector_fails_at_startup() -> None:
    with pytest.raises(ConfigError, match=r"stage 2: cannot create connector 'nope'"):
        StageTransferRuntime(StageConfig(stage_id=2), {"name": "nope"})


def test_to_stage_default_and_numeric_string(runtimes: list, namespace: str) -> None:
    rt = make_runtime(4, namespace)
    runtimes.append(rt)
    assert rt.next_stage_id == 5 and rt.from_stage == 3
    rt2 = StageTransferRuntime(StageConfig(stage_id=0), {"name": "memory", "extra": {"namespace": namespace}, "to_stage": "7"})
    runtimes.append(rt2)
    assert rt2.next_stage_id == 7


def test_local_rank_from_environment(monkeypatch: pytest.MonkeyPatch, runtimes: list, namespace: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    rt = StageTransferRuntime(StageConfig(stage_id=1), {"name": "memory", "extra": {"namespace": namespace}, "rank_mapping": {"from_tp": 1, "to_tp": 2}})
    runtimes.append(rt)
    assert rt.local_rank == 1 and rt.get_kv_remote_ranks() == [0]
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ConfigError, match="LOCAL_RANK"):
        StageTransferRuntime(StageConfig(stage_id=1))


def test_from_pipeline(namespace: str) -> None:
    pipe = PipelineConfig.model_validate(
        {
            "connectors": {"mem": {"name": "memory", "extra": {"namespace": namespace}}},
            "stages": [{"stage_id": 0, "output_connectors": {"to_stage_1": "mem"}}, {"stage_id": 1, "input_connectors": {"from_stage_0": "mem"}}],
        }
    )
    with StageTransferRuntime.from_pipeline(pipe, 0) as rt0, StageTransferRuntime.from_pipeline(pipe, 1) as rt1:
        assert rt0.connector is not None and rt0.next_stage_id == 1
        assert rt1.from_stage == 0 and rt1.arrival_mode == "block"
    assert rt0.closed and rt1.closed


def test_builder_derivation_prefers_full_payload_then_batch_then_plain(runtimes: list, namespace: str) -> None:
    rt = make_runtime(0, namespace, custom_process_input_func="rt_builders.prep")
    runtimes.append(rt)
    assert rt.builder is not None and rt.builder.path == "rt_builders.prep_full_payload"
    rt2 = make_runtime(0, namespace, custom_process_input_func="rt_builders.only_batch")
    runtimes.append(rt2)
    assert rt2.builder is not None and rt2.builder.path == "rt_builders.only_batch_batch"  # bad-signature candidate skipped
    # streaming mode never derives
    rt3 = make_runtime(0, namespace, async_chunk=True, custom_process_input_func="rt_builders.prep")
    runtimes.append(rt3)
    assert rt3.builder is None
    # derivation alone does not open the accumulation gate
    assert not rt.should_accumulate_full_payload_output()


def test_builder_derivation_order_when_every_candidate_exists(runtimes: list, namespace: str) -> None:
    rt = make_runtime(0, namespace, custom_process_input_func="rt_builders.both")
    runtimes.append(rt)
    assert rt.builder is not None and rt.builder.path == "rt_builders.both_full_payload"


def test_builder_derivation_falls_back_to_the_input_func_itself(runtimes: list, namespace: str) -> None:
    rt = make_runtime(0, namespace, custom_process_input_func="rt_builders.plain_only")
    runtimes.append(rt)
    assert rt.builder is not None and rt.builder.path == "rt_builders.plain_only"


def test_explicit_bad_builder_fails_at_startup(namespace: str) -> None:
    with pytest.raises(BuilderError):
        make_runtime(0, namespace, custom_process_next_stage_input_func="rt_builders.only_batch_full_payload")
    with pytest.raises(BuilderError):
        make_runtime(0, namespace, custom_process_next_stage_input_func="rt_builders.does_not_exist")


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        ({"custom_process_next_stage_input_func": "rt_builders.whole", "model_stage": "thinker"}, True),
        ({"custom_process_next_stage_input_func": "rt_builders.whole"}, False),  # no model stage
        ({"custom_process_next_stage_input_func": "rt_builders.whole", "model_stage": "t", "final_output": True}, False),
        ({"custom_process_next_stage_input_func": "rt_builders.stream", "model_stage": "t", "async_chunk": True}, False),
        ({"custom_process_input_func": "rt_builders.prep", "model_stage": "t"}, False),  # derived builder only
    ],
)
def test_accumulation_gate(stage: dict, expected: bool, runtimes: list, namespace: str) -> None:
    rt = make_runtime(0, namespace, **stage)
    runtimes.append(rt)
    assert rt.should_accumulate_full_payload_output() is expected
    assert rt.accumulate_full_payload_output("r", {"h": torch.ones(1, 2)}, Req("r")) is expected
    assert (rt.active_request_count() == 1) is expected


def test_gate_closed_without_connector() -> None:
    rt = StageTransferRuntime(StageConfig(stage_id=0, custom_process_next_stage_input_func="rt_builders.whole", model_stage="t"))
    assert not rt.should_accumulate_full_payload_output()
    rt.shutdown()
