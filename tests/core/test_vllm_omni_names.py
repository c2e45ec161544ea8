"""vLLM-Omni connector names: the plugins' declarations, and how a vLLM-Omni file's connectors read through them."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from omni_plugins import ConfigError
from omni_plugins.config import parse_pipeline_config
from omni_plugins.errors import DuplicateConnectorError
from omni_plugins.registry import ConnectorRegistry, RegistrationSink

TWO_STAGES = """\
stage_args:
  - {stage_id: 0, engine_args: {model_stage: thinker}, output_connectors: {to_stage_1: c}}
  - {stage_id: 1, engine_args: {model_stage: talker}, input_connectors: {from_stage_0: c}}
runtime:
  connectors:
    c:
      name: NAME
      extra: EXTRA
"""


def two_stages(name: str, extra: str = "{}", **kw: object) -> object:
    return parse_pipeline_config(TWO_STAGES.replace("NAME", name).replace("EXTRA", extra), filename="p.yaml", **kw)  # type: ignore[arg-type]


def test_declarations_are_checked_and_a_name_declared_twice_is_an_error() -> None:
    registry = ConnectorRegistry()
    a, b = RegistrationSink(registry, "a", "dist-a", "1"), RegistrationSink(registry, "b", "dist-b", "1")
    with pytest.raises(ValueError, match="exactly one of connector= and translate="):
        a.register_vllm_omni("XConnector", connector="x", translate="m.n:f")
    with pytest.raises(ValueError, match="must map strings to strings"):
        a.register_vllm_omni("XConnector", connector="x", keys={"host": 1})  # type: ignore[dict-item]
    a.register_vllm_omni("XConnector", connector="x", keys={"host": "hostname"}, unused={"port": "found otherwise"})
    a.register_vllm_omni("XConnector", connector="x")  # the same plugin again: idempotent
    decl = registry.vllm_omni_name("XConnector")
    assert decl is not None and (decl.connector, dict(decl.keys), decl.distribution) == ("x", {"host": "hostname"}, "dist-a")
    assert registry.vllm_omni_name("YConnector") is None
    b.register_vllm_omni("*", translate="m.n:f")
    assert registry.vllm_omni_name("YConnector") is not None and registry.vllm_omni_name("YConnector", catch_all=False) is None
    b.register_vllm_omni("XConnector", connector="y")
    with pytest.raises(DuplicateConnectorError, match="'XConnector' is declared by more than one plugin"):
        registry.vllm_omni_name("XConnector")
    registry.remove_plugin("b")
    assert registry.vllm_omni_name("XConnector") is decl and registry.vllm_omni_name("YConnector") is None


def test_extra_keys_are_renamed_kept_or_left_to_the_builders(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_plugins.config.vllm_omni"):
        cfg = two_stages("MooncakeConnector", '{host: "10.0.0.2", master: "10.0.0.1:50051", protocol: tcp, mastr: "x", codec_chunk_frames: 25}')
    conn = cfg.connectors["c"]  # type: ignore[attr-defined]
    assert conn.name == "mooncake-store"
    assert conn.extra == {"local_hostname": "10.0.0.2", "master_address": "10.0.0.1:50051", "protocol": "tcp"}  # renamed, own as is
    assert conn.builder_settings["codec_chunk_frames"] == 25 and conn.builder_settings["mastr"] == "x"  # the extra as written
    near = [r.getMessage() for r in caplog.records if "did you mean" in r.getMessage()]
    assert near == ["p.yaml:8: runtime.connectors.c.extra.mastr: 'mastr' is not a setting of 'mooncake-store' and is left to the payload builders (did you mean 'master'?)"]


def test_a_bad_setting_is_reported_at_the_key_as_written() -> None:
    with pytest.raises(ConfigError) as info:
        two_stages("MooncakeTransferEngineConnector", "{memory_pool_size: lots}", check_builders=False)
    assert str(info.value).startswith("p.yaml:8: runtime.connectors.c.extra.memory_pool_size: could not parse value and unit"), str(info.value)


def test_names_that_cannot_be_served_say_why() -> None:
    with pytest.raises(ConfigError, match=r"p.yaml:7: runtime.connectors.c.name: unknown connector 'SharedMemoyConnector'; did you mean 'SharedMemoryConnector'"):
        two_stages("SharedMemoyConnector")  # not handed to the vllm-omni connector as one of vLLM-Omni's own
    with pytest.raises(ConfigError, match=r"p.yaml:7: runtime.connectors.c \(used by stage 0, 1\): unknown connector 'nope'"):
        two_stages("nope")
    with pytest.raises(ConfigError, match=r"p.yaml:7: runtime.connectors.c.name: OmniPlugins: extra.backend_config must be a mapping"):
        two_stages("OmniPlugins", "{backend: shm, backend_config: [1]}")


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="with vLLM-Omni, the vllm-omni connector serves it")
def test_a_connector_no_edge_uses_is_noted_when_it_cannot_be_served(caplog: pytest.LogCaptureFixture) -> None:
    text = TWO_STAGES.replace("NAME", "SharedMemoryConnector").replace("EXTRA", "{}") + "    spare: {name: YuanrongConnector}\n"
    with caplog.at_level(logging.WARNING, logger="omni_plugins.config.vllm_omni"):
        cfg = parse_pipeline_config(text, filename="p.yaml")
    assert sorted(cfg.connectors) == ["c"]
    assert any("p.yaml:9: runtime.connectors.spare: connector 'spare' is used by no edge and is not checked" in r.getMessage() for r in caplog.records)


def test_our_own_names_keep_our_settings() -> None:
    """A connector named by omni-plugins' name takes omni-plugins settings, in a vLLM-Omni file too."""
    cfg = two_stages("shm", "{namespace: ours, pool_bytes: 0}")
    assert cfg.connectors["c"].extra == {"namespace": "ours", "pool_bytes": 0}  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="unknown field 'shm_threshold_bytes'"):
        two_stages("shm", "{shm_threshold_bytes: 1}")


def test_without_the_vllm_omni_plugin_vllm_omni_connectors_are_refused_with_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_plugins.plugins import PluginManager, set_plugin_manager

    monkeypatch.setenv("OMNI_PLUGINS_DISABLE", "vllm_omni")
    previous = set_plugin_manager(PluginManager())
    try:
        with pytest.raises(ConfigError) as info:
            two_stages("NixlConnector")
    finally:
        set_plugin_manager(previous)
    assert str(info.value) == (
        "p.yaml:7: runtime.connectors.c.name: connector 'NixlConnector': it is one of vLLM-Omni's own connectors, which omni-plugins "
        "runs through its 'vllm-omni' connector: pip install omni-plugins-vllm-omni together with vllm-omni and the vLLM build for this machine"
    )
