"""Entry point (group ``omni_plugins``): registers the ``vllm-omni`` connector. Imports nothing heavy.

It also says how vLLM-Omni YAML files name this plugin's connectors (:mod:`omni_plugins_vllm_omni.yaml_names`).
"""

from __future__ import annotations

from omni_plugins import RegistrationSink, hookimpl
from omni_plugins_vllm_omni import BRIDGE_NAME, CONNECTOR_NAME


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        BRIDGE_NAME,
        connector="omni_plugins_vllm_omni.bridge:VllmOmniConnector",
        config="omni_plugins_vllm_omni.bridge_config:VllmOmniConfig",
        description="any connector vLLM-Omni's factory builds (NIXL, Mori, Yuanrong, its shared memory); needs vllm-omni",
        services="omni_plugins_vllm_omni.services:VllmOmniServices",
    )
    registry.register_vllm_omni(
        CONNECTOR_NAME,
        translate="omni_plugins_vllm_omni.yaml_names:from_omni_plugins",
        description="the omni-plugins backend extra.backend names, extra.backend_config its settings",
    )
    registry.register_vllm_omni(
        "*",
        translate="omni_plugins_vllm_omni.yaml_names:through_vllm_omni",
        description="vLLM-Omni's own connector, built by its factory inside the vllm-omni connector (needs vllm-omni)",
    )
