"""Config models and the YAML loader."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest

from omni_plugins import ConfigError, PipelineConfig, RankMapping, load_pipeline_config
from omni_plugins.config import StageConnectorConfig, parse_pipeline_config
from omni_plugins.config.interpolate import interpolate

BAD_DIR = Path(__file__).resolve().parents[1] / "data" / "bad_configs"
BAD_FILES = sorted(BAD_DIR.glob("*.yaml"))

GOOD = """
connectors:
  fast: {name: memory, extra: {namespace: "${OMNI_TEST_NS:-pipeline}"}}
stages:
  - stage_id: 0
    worker_type: ar
    model_stage: thinker
    custom_process_next_stage_input_func: omni_plugins.testing.builders.passthrough
    output_connectors: {to_stage_1: fast}
  - stage_id: 1
    worker_type: generation
    async_chunk: true
    input_connectors: {from_stage_0: fast}
    output_connectors: {to_stage_2: fast}
    rank_mapping: {from_tp: 2, to_tp: 1}
  - stage_id: 2
    final_output: true
    input_connectors: {from_stage_1: fast}
"""


def test_at_least_thirty_bad_config_files() -> None:
    assert len(BAD_FILES) >= 30


@pytest.mark.parametrize("path", BAD_FILES, ids=[p.stem for p in BAD_FILES])
def test_bad_config_rejected_naming_file_and_field(path: Path) -> None:
    expect = re.search(r"^# expect: (.+)$", path.read_text(), re.M)
    assert expect, f"{path.name} needs a '# expect:' line"
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    message = str(info.value)
    assert str(path) in message, message
    assert expect.group(1).strip() in message, message


def test_error_names_line_and_stage() -> None:
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(BAD_DIR / "bad_rank_mapping_divisible.yaml")
    assert re.search(r"bad_rank_mapping_divisible\.yaml:5: stages\[0\] \(stage 0\)\.rank_mapping", str(info.value)), str(info.value)


GRAPH = """\
connectors:
  c: {name: memory}
  d: {name: memory}
default_connector: c
stages:
  - stage_id: 0
  - stage_id: 1
  - stage_id: 2
  - stage_id: 3
    output_connectors:
      to_stage_4: c
"""


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("to_stage_4: c", "to_stage_4: nope", "p.yaml:11: stages[3] (stage 3).output_connectors.to_stage_4: connector instance 'nope' is not defined"),
        ("", "", "p.yaml:11: stages[3] (stage 3).output_connectors.to_stage_4: stage 4 does not exist (stages: [0, 1, 2, 3])"),
        ("stage_id: 2", "stage_id: 1", "p.yaml:8: stages[2] (stage 1).stage_id: duplicate stage_id [1] (also stages[1])"),
        ("default_connector: c", "default_connector: e", "p.yaml:4: default_connector: default_connector 'e' is not defined"),
        (
            "  - stage_id: 1\n",
            "  - stage_id: 1\n    input_connectors: {from_stage_3: d}\n",
            "p.yaml:12: stages[3] (stage 3).output_connectors.to_stage_1: uses 'c' but stage 1: input_connectors.from_stage_3 uses 'd'",
        ),
        (
            "  - stage_id: 1\n",
            "  - stage_id: 1\n    output_connectors:\n      to_stage_3: c\n",
            "p.yaml:13: stages[3] (stage 3).output_connectors.to_stage_1: stage graph has a cycle: 1 -> 3 -> 1",
        ),
    ],
    ids=["undefined-instance", "no-such-stage", "duplicate-stage-id", "default-connector", "ends-disagree", "cycle"],
)
def test_graph_errors_name_line_and_edge(old: str, new: str, expect: str) -> None:
    """Graph checks run on the whole model, yet each error names the line and path of what it is about."""
    text = GRAPH if "to_stage_4" in expect else GRAPH.replace("to_stage_4: c", "to_stage_1: c")
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(text.replace(old, new), filename="p.yaml")
    assert str(info.value).startswith(expect), str(info.value)


def test_good_config_and_stage_connector_config(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD)
    cfg = load_pipeline_config(path, env={})
    assert isinstance(cfg, PipelineConfig)
    assert cfg.edges() == {(0, 1), (1, 2)}
    s0 = cfg.stage_connector_config(0)
    assert s0 == StageConnectorConfig(name="memory", extra={"namespace": "pipeline"}, to_stage=1)
    s1 = cfg.stage_connector_config(1)
    assert s1 is not None and s1.to_stage == 2 and s1.rank_mapping == RankMapping(from_tp=2, to_tp=1)
    s2 = cfg.stage_connector_config(2)
    assert s2 is not None and s2.name == "memory"


def test_interpolation_uses_env_and_types(tmp_path: Path) -> None:
    text = GOOD.replace("${OMNI_TEST_NS:-pipeline}", "${NS}") + "default_connector: ${DEF:-fast}\n"
    cfg = parse_pipeline_config(text, env={"NS": "from-env"})
    assert cfg.connectors["fast"].extra == {"namespace": "from-env"}
    assert cfg.default_connector == "fast"
    typed = parse_pipeline_config("stages:\n  - stage_id: ${ID}\n    tp_size: ${TP:-2}\n", env={"ID": "3"})
    assert typed.stages[0].stage_id == 3 and typed.stages[0].tp_size == 2
    literal = parse_pipeline_config("stages:\n  - {stage_id: 0, model_stage: 'cost$$5'}\n", env={})
    assert literal.stages[0].model_stage == "cost$5"


def test_interpolated_scalars_never_build_structure() -> None:
    """A substituted value is never parsed as YAML structure: a variable cannot smuggle in a list, a
    map or an alias bomb past the node limit."""
    bomb = "[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]]"
    text = "".join(
        f"  - stage_id: {sid}\n    model_stage: {ms}\n    final_output: ${{B}}\n"
        for sid, ms in (("${A}", "${C}"), ("1", "${D}"), ("2", "x${E:-}y"))
    )
    cfg = parse_pipeline_config("stages:\n" + text, env={"A": "0", "B": "true", "C": bomb, "D": "{k: v}", "E": "[1]"})
    assert [s.stage_id for s in cfg.stages] == [0, 1, 2] and all(s.final_output is True for s in cfg.stages)
    assert [s.model_stage for s in cfg.stages] == [bomb, "{k: v}", "x[1]y"]


REDIS_SECRET = """
connectors:
  r:
    name: redis
    extra:
      host: 127.0.0.1
      password: ${REDIS_PASSWORD}
      port: ${PORT:-6379}
      tls: ${TLS:-false}
  s:
    name: shm
    extra:
      namespace: ${NS}
stages:
  - {stage_id: 0, output_connectors: {to_stage_1: r}}
  - {stage_id: 1, input_connectors: {from_stage_0: r}}
"""


@pytest.mark.parametrize("secret", ["123456", "null", "~", "true", "0x1F", "1e3"])
def test_interpolated_value_stays_a_string(secret: str) -> None:
    """What a variable holds is not YAML: REDIS_PASSWORD=null must not silently mean 'no password'."""
    cfg = parse_pipeline_config(REDIS_SECRET, env={"REDIS_PASSWORD": secret, "NS": "2024"}, check_builders=False)
    assert cfg.connectors["r"].extra["password"] == secret
    assert cfg.connectors["s"].extra == {"namespace": "2024"}


def test_interpolated_numbers_still_validate_numeric_fields() -> None:
    from omni_plugins.factory import validate_connector_config

    cfg = parse_pipeline_config(REDIS_SECRET, env={"REDIS_PASSWORD": "pw", "NS": "n", "PORT": "6380", "TLS": "true"})
    settings: Any = validate_connector_config("redis", cfg.connectors["r"].extra)
    assert settings.port == 6380 and settings.tls is True
    with pytest.raises(ConfigError, match="port"):
        parse_pipeline_config(REDIS_SECRET, env={"REDIS_PASSWORD": "pw", "NS": "n", "PORT": "http"})


@pytest.mark.parametrize("value", ["${REDIS_PASSWORD-}", "${Z:default}", "${Z", "${Z:-${A}}", "ok ${}", "${1Z}", "$$${Z"])
def test_malformed_reference_is_an_error(value: str) -> None:
    """Left as text, ``password: ${REDIS_PASSWORD-}`` would be a password of 18 characters."""
    text = f"stages:\n  - stage_id: 0\n    model_stage: '{value}'\n"
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(text, filename="p.yaml", env={"A": "a", "Z": "z", "REDIS_PASSWORD": "pw"})
    message = str(info.value)
    assert message.startswith("p.yaml:3: stages[0].model_stage: malformed reference '${") and "${VAR:-default}" in message, message


def test_escaped_reference_is_text() -> None:
    cfg = parse_pipeline_config("stages:\n  - stage_id: 0\n    model_stage: '$${Z} $${Z:-x} $$${Z}'\n", env={"Z": "z"})
    assert cfg.stages[0].model_stage == "${Z} ${Z:-x} $z"


def test_plugin_extra_errors_one_line_each_at_their_key_with_hint() -> None:
    text = """\
connectors:
  r:
    name: redis
    extra:
      key_prefix: "omni:"
      chunk_bytes: -5
      pool_sise: 4
      frobnicate: 1
stages:
  - {stage_id: 0, output_connectors: {to_stage_1: r}}
  - {stage_id: 1, input_connectors: {from_stage_0: r}}
"""
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(text, filename="p.yaml")
    lines = str(info.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("p.yaml:6: connectors.r.extra.chunk_bytes: Input should be greater than or equal to"), lines
    assert lines[1].startswith("p.yaml:7: connectors.r.extra.pool_sise: unknown field 'pool_sise' (did you mean 'pool_size'?)"), lines
    assert lines[2].startswith("p.yaml:8: connectors.r.extra.frobnicate: unknown field 'frobnicate' ('omni-plugins schema redis' lists"), lines
    assert all("[connector 'redis' from plugin 'redis'" in line and "used by stage 0, 1]" in line for line in lines), lines


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("stages:\n  - stage_id: 0\n    model_stage: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:3: not UTF-8 text \(byte 0xe9 at offset 44\)"):
        load_pipeline_config(path)


MERGE = """\
x-common: &common
  async_chunk: true
  tp_size: 2
x-more: &more {tp_size: 3, model_stage: m}
connectors:
  c: {name: memory}
stages:
  - <<: [*common, *more]
    stage_id: 0
    output_connectors: {to_stage_1: c}
  - <<: *more
    stage_id: 1
    tp_size: 4
    input_connectors: {from_stage_0: c}
"""


def test_merge_keys() -> None:
    """Own keys win over merged ones, earlier merged mappings over later ones; x-* keys are ignored."""
    cfg = parse_pipeline_config(MERGE)
    assert [(s.async_chunk, s.tp_size, s.model_stage) for s in cfg.stages] == [(True, 2, "m"), (False, 4, "m")]


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("tp_size: 2", "tp_size: 0", "p.yaml:3: stages[0] (stage 0).tp_size: Input should be greater than 0"),
        ("model_stage: m}", "model_stage: m, bogus: 1}", "p.yaml:4: stages[0] (stage 0).bogus: unknown field 'bogus'"),
        ("    tp_size: 4\n", "    tp_size: 4\n    tp_size: 5\n", "p.yaml:13: stages[1].tp_size: duplicate key 'tp_size'"),
        ("  - <<: *more\n", "  - <<: [*more, 1]\n", "p.yaml:11: stages[1]: '<<' (merge key) takes a mapping or a list of mappings"),
        ("x-more:", "more:", "p.yaml:4: more: unknown field 'more'"),
    ],
)
def test_merge_key_errors_name_the_line(old: str, new: str, expect: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(MERGE.replace(old, new), filename="p.yaml")
    assert str(info.value).startswith(expect), str(info.value)


@pytest.mark.parametrize(
    ("field", "expect"),
    [
        ("stage_id: true", "stage_id: Input should be a valid integer"),
        ("stage_id: 2.0", "stage_id: Input should be a valid integer"),
        ("stage_id: 99999999999999999999999", "stage_id: Input should be less than or equal to 9999"),
        ("stage_id: 0, kv_transfer: 'yes'", "kv_transfer: Input should be a valid boolean"),
        ("stage_id: 0, kv_transfer: 1", "kv_transfer: Input should be a valid boolean"),
        ("stage_id: 0, final_output: 'on'", "final_output: Input should be a valid boolean"),
        ("stage_id: 0, tp_size: true", "tp_size: Input should be a valid integer"),
        ("stage_id: 0, rank_mapping: {from_tp: true}", "rank_mapping.from_tp: Input should be a valid integer"),
        ("stage_id: 0, recv_timeout_s: true", "recv_timeout_s: Input should be a number, not a boolean"),
    ],
)
def test_strict_types(field: str, expect: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expect)):
        parse_pipeline_config(f"stages:\n  - {{{field}}}\n")


@pytest.mark.parametrize(
    ("value", "env", "expect"),
    [
        ("${oc.env:R,redis://127.0.0.1:6379/0}", {}, "redis://127.0.0.1:6379/0"),
        ("${oc.env:R,redis://h:1/0}", {"R": "redis://x:2/1"}, "redis://x:2/1"),
        ("${oc.env:R,dflt}", {"R": ""}, ""),  # OmegaConf's rule: the default only when unset
        ("${oc.env:R,'a,b'}", {}, "a,b"),
        ("pre-${oc.env:R, x }-post", {}, "pre-x-post"),
        ("${oc.env:R}", {"R": "set"}, "set"),
    ],
)
def test_omegaconf_env_references_resolve_as_omegaconf_does(value: str, env: dict[str, str], expect: str) -> None:
    """vLLM-Omni's deploy files are OmegaConf files: ${oc.env:VAR,default} is how they read a variable."""
    assert interpolate(value, env) == expect


def test_omegaconf_env_reference_without_default_needs_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"p.yaml:3: stages\[0\].model_stage: environment variable \$\{R\} is not set"):
        parse_pipeline_config("stages:\n  - stage_id: 0\n    model_stage: ${oc.env:R}\n", filename="p.yaml", env={})
    with pytest.raises(ConfigError, match="malformed reference"):
        parse_pipeline_config("stages:\n  - stage_id: 0\n    model_stage: ${oc.env:R,${S}}\n", filename="p.yaml", env={})


def test_interpolated_text_fills_typed_fields() -> None:
    """Interpolation gives strings; int, bool and float fields take their text forms (not bools / yes)."""
    text = "stages:\n  - stage_id: ${ID}\n    tp_size: ${TP:-2}\n    kv_transfer: ${KV}\n    recv_timeout_s: ${T}\n"
    s = parse_pipeline_config(text, env={"ID": "9999", "KV": "True", "T": "1.5"}).stages[0]
    assert (s.stage_id, s.tp_size, s.kv_transfer, s.recv_timeout_s) == (9999, 2, True, 1.5)
    with pytest.raises(ConfigError, match="kv_transfer: Input should be a valid boolean"):
        parse_pipeline_config(text, env={"ID": "1", "KV": "yes", "T": "1"})
    with pytest.raises(ConfigError, match="stage_id: Input should be a valid integer"):
        parse_pipeline_config(text, env={"ID": "1.0", "KV": "false", "T": "1"})
    assert StageConnectorConfig(name="memory", to_stage="3").to_stage == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="valid integer"):
        StageConnectorConfig(name="memory", to_stage=True)


def test_no_connector_config_means_none() -> None:
    cfg = parse_pipeline_config("stages:\n  - {stage_id: 0}\n")
    assert cfg.stage_connector_config(0) is None


def test_default_connector_wires_unwired_stages() -> None:
    cfg = parse_pipeline_config("default_connector: c\nconnectors: {c: {name: memory}}\nstages:\n  - {stage_id: 0}\n  - {stage_id: 1}\n")
    sc = cfg.stage_connector_config(0)
    assert sc is not None and sc.name == "memory" and sc.to_stage == 1


def test_peer_layout_is_accepted() -> None:
    text = """
runtime:
  connectors:
    shm: {name: memory, extra: {}}
stage_args:
  - stage_id: 0
    engine_args: {model_stage: thinker, worker_type: ar, max_model_len: 4096}
    output_connectors: {to_stage_1: shm}
  - stage_id: 1
    engine_args: {model_stage: talker, worker_type: generation, async_chunk: true}
    input_connectors: {from_stage_0: shm}
"""
    cfg = parse_pipeline_config(text)
    assert [s.model_stage for s in cfg.stages] == ["thinker", "talker"]
    assert cfg.stages[1].async_chunk is True and cfg.stages[1].worker_type == "generation"


PEER2 = """\
stage_args:
  - stage_id: 0
    runtime: {process: true, devices: "0", max_batch_size: 1}
    engine_args:
      model_stage: thinker
      worker_type: ar
      gpu_memory_utilization: 0.8
    is_comprehension: true
    final_output: true
    final_output_type: text
    default_sampling_params: {temperature: 0.0}
    output_connectors:
      to_stage_1: connector_of_mooncake
  - stage_id: 1
    runtime: {process: true, devices: "1"}
    engine_args: {model_stage: talker}
    engine_input_source: [0]
    custom_process_input_func: vllm_omni.model_executor.stage_input_processors.qwen2_5_omni.thinker2talker
    input_connectors:
      from_stage_0: connector_of_mooncake
runtime:
  enabled: true
  defaults: {window_size: -1, max_inflight: 1}
  connectors:
    connector_of_mooncake:
      name: MooncakeConnector
      extra: {host: "127.0.0.1", metadata_server: "http://127.0.0.1:8080/metadata", master: "127.0.0.1:50051", segment: 512000000}
    connector_of_shared_memory:
      name: SharedMemoryConnector
  edges:
    - {from: 0, to: 1, window_size: -1}
"""


def test_peer_settings_not_used_are_kept_and_listed_in_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_plugins.config.vllm_omni"):
        cfg = parse_pipeline_config(PEER2, filename="peer2.yaml")
    assert [(s.stage_id, s.model_stage, s.final_output) for s in cfg.stages] == [(0, "thinker", True), (1, "talker", False)]
    assert sorted(cfg.connectors) == ["connector_of_mooncake", "connector_of_shared_memory"] and cfg.edges() == {(0, 1)}
    [record] = caplog.records
    for ignored in ("runtime.enabled", "runtime.defaults", "runtime.process (stage 0, 1)", "devices (stage 0, 1)", "is_comprehension (stage 0)",
                    "final_output_type (stage 0)", "default_sampling_params (stage 0)", "gpu_memory_utilization (stage 0)"):  # fmt: skip
        assert ignored in record.getMessage(), record.getMessage()
    assert "engine_input_source" not in record.getMessage() and "runtime.edges," not in record.getMessage()  # both are read (edges)
    assert cfg.stages[0].vllm_omni["gpu_memory_utilization"] == 0.8 and cfg.stages[1].vllm_omni["devices"] == "1"
    assert cfg.vllm_omni["runtime.defaults"] == {"window_size": -1, "max_inflight": 1}


def test_a_native_file_keeps_its_strict_checks() -> None:
    """Without a key of vLLM-Omni's layouts a file is native: an unknown key is an error with a hint."""
    with pytest.raises(ConfigError, match=r"p.yaml:2: stages\[0\] \(stage 0\).model_stag: unknown field 'model_stag' \(did you mean 'model_stage'\?\)"):
        parse_pipeline_config("stages:\n  - {stage_id: 0, model_stag: thinker}\n", filename="p.yaml")
    with pytest.raises(ConfigError, match=r"p.yaml:1: conectors: unknown field 'conectors' \(did you mean 'connectors'\?\)"):
        parse_pipeline_config("conectors: {}\nstages:\n  - {stage_id: 0}\n", filename="p.yaml")


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        ("worker_type: ar", "worker_type: xx", "p.yaml:6: stage_args[0] (stage 0).engine_args.worker_type: Input should be 'ar' or 'generation'"),
        ("    engine_input_source: [0]\n", "    engine_input_source: [0]\n    tp_size: 0\n", "p.yaml:18: stage_args[1] (stage 1).tp_size:"),
        ("to_stage_1: connector_of_mooncake", "to_stage_2: connector_of_mooncake", "p.yaml:13: stage_args[0] (stage 0).output_connectors.to_stage_2:"),
        ('master: "127.0.0.1:50051"', 'master: "x"', "p.yaml:27: runtime.connectors.connector_of_mooncake.extra.master: master_address must"),
        ("name: SharedMemoryConnector", "name: nope", "p.yaml:29: runtime.connectors.connector_of_shared_memory: unknown connector 'nope'"),
    ],
)
def test_peer_layout_errors_name_the_written_path_and_line(old: str, new: str, expect: str) -> None:
    """Errors in a vllm-omni file point at what is written (stage_args, engine_args, runtime.connectors), not the renamed path."""
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(PEER2.replace(old, new), filename="p.yaml")
    assert str(info.value).startswith(expect), str(info.value)


def test_yaml_is_loaded_safely() -> None:
    with pytest.raises(ConfigError):
        parse_pipeline_config("stages: !!python/object/apply:os.system ['echo pwned']\n")


@pytest.mark.parametrize(
    ("from_tp", "to_tp", "ok"),
    [(1, 1, True), (2, 1, True), (1, 4, True), (4, 2, True), (3, 2, False), (2, 6, True), (4, 6, False)],
)
def test_rank_mapping_divisibility(from_tp: int, to_tp: int, ok: bool) -> None:
    if ok:
        assert RankMapping(from_tp=from_tp, to_tp=to_tp).ratio == max(from_tp, to_tp) // min(from_tp, to_tp)
    else:
        with pytest.raises(ValueError, match="divisible"):
            RankMapping(from_tp=from_tp, to_tp=to_tp)


def test_stage_connector_config_to_stage_numeric_string() -> None:
    assert StageConnectorConfig(name="memory", to_stage="3").to_stage == 3  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="numeric"):
        StageConnectorConfig(name="memory", to_stage="three")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="blank"):
        StageConnectorConfig(name=" ")
    with pytest.raises(ValueError):
        StageConnectorConfig(name="memory", extra=[1])  # type: ignore[arg-type]
