"""The ``vllm_omni.general_plugins`` entry point registers ``OmniPlugins`` in every process, once."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

from omni_plugins_vllm_omni import CONNECTOR_NAME
from omni_plugins_vllm_omni.register import create, register
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
from vllm_omni.plugins import load_omni_general_plugins

BUILT_IN = {
    "SharedMemoryConnector",
    "MooncakeStoreConnector",
    "MooncakeConnector",
    "MooncakeTransferEngineConnector",
    "YuanrongConnector",
    "YuanrongTransferEngineConnector",
    "MoriTransferEngineConnector",
    "NixlConnector",
}


def test_the_entry_point_registers_the_connector_in_a_fresh_vllm_omni_process(stage: Any) -> None:
    seen = stage.ready()
    assert CONNECTOR_NAME not in seen["before"]
    assert CONNECTOR_NAME in seen["after"]
    assert set(seen["after"]) >= BUILT_IN  # vLLM-Omni's own connectors untouched


def test_the_entry_point_registers_in_this_process_too_and_loading_again_is_harmless() -> None:
    load_omni_general_plugins()
    assert OmniConnectorFactory.list_registered_connectors().count(CONNECTOR_NAME) == 1
    register()
    register()
    assert OmniConnectorFactory._registry[CONNECTOR_NAME] is create
    assert CONNECTOR_NAME not in BUILT_IN


def test_a_name_taken_by_another_plugin_is_left_to_it(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def other(config: dict[str, Any]) -> Any:
        raise AssertionError("not called")

    registry = {k: v for k, v in OmniConnectorFactory._registry.items() if k != CONNECTOR_NAME}
    registry[CONNECTOR_NAME] = other
    monkeypatch.setattr(OmniConnectorFactory, "_registry", registry)
    monkeypatch.setattr("omni_plugins_vllm_omni.register._registered", False)  # as in a process where the other plugin came first
    with caplog.at_level(logging.WARNING, logger="omni_plugins_vllm_omni"):
        register()
    assert OmniConnectorFactory._registry[CONNECTOR_NAME] is other
    assert "omni-plugins did not register it" in caplog.text
