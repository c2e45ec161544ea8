"""vLLM-Omni compatibility for omni-plugins, both ways.

- ``OmniPlugins``: a connector of vLLM-Omni (on its ``OmniConnectorBase``) that serves any installed
  omni-plugins backend; registered in vLLM-Omni through its ``vllm_omni.general_plugins`` entry point
  (:mod:`omni_plugins_vllm_omni.register`).
- ``vllm-omni``: an omni-plugins connector that wraps any connector vLLM-Omni's factory builds
  (NIXL, Mori, Yuanrong, its shared memory ...); registered through omni-plugins' own entry point
  (:mod:`omni_plugins_vllm_omni.plugin`).

Importing this package imports neither vLLM-Omni nor torch.
"""

#: the name vLLM-Omni YAML files give the connector that serves omni-plugins backends (never a built-in name)
CONNECTOR_NAME = "OmniPlugins"
#: the omni-plugins connector that wraps vLLM-Omni's connectors
BRIDGE_NAME = "vllm-omni"

__all__ = ["BRIDGE_NAME", "CONNECTOR_NAME"]
