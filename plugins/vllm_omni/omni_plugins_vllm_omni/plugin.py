"""Entry point (group ``omni_plugins``): registers the ``vllm-omni`` connector. Imports nothing heavy."""

from __future__ import annotations

from omni_plugins import RegistrationSink, hookimpl
from omni_plugins_vllm_omni import BRIDGE_NAME


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        BRIDGE_NAME,
        connector="omni_plugins_vllm_omni.bridge:VllmOmniConnector",
        config="omni_plugins_vllm_omni.bridge_config:VllmOmniConfig",
        description="any connector vLLM-Omni's factory builds (NIXL, Mori, Yuanrong, its shared memory); needs vllm-omni",
        services="omni_plugins_vllm_omni.services:VllmOmniServices",
    )
