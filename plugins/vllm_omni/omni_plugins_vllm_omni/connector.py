"""``OmniPlugins``: a vLLM-Omni connector (``OmniConnectorBase``) backed by any omni-plugins connector.

vLLM-Omni calls it as it calls its own connectors (``put``/``get`` by keyword, key-only gets,
``get_with_deadline``, ``cleanup``, ``health``, ``close`` from ``__del__``); every call goes to one
omni-plugins connector (``extra.backend``) created with ``extra.backend_config``. Errors take
vLLM-Omni's shapes: a failed ``put`` is logged and returns ``(False, 0, None)``, a failed or empty
``get`` is logged and returns ``None``, ``health()`` says ``status: healthy|unhealthy`` (with
``error``) beside the counters its connectors report.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm_omni.distributed.omni_connectors.connectors.base import OmniConnectorBase

from omni_plugins import Connector, create_connector
from omni_plugins.errors import WireFormatError
from omni_plugins.factory import resolve_connector
from omni_plugins_vllm_omni import BRIDGE_NAME, CONNECTOR_NAME
from omni_plugins_vllm_omni.extra import AdapterSettings, split_extra
from omni_plugins_vllm_omni.keys import edge_key
from omni_plugins_vllm_omni.payloads import from_wire, to_wire
from omni_plugins_vllm_omni.pending import PendingPuts

log = logging.getLogger(__name__)


class OmniPluginsConnector(OmniConnectorBase):  # type: ignore[misc]  # vLLM-Omni is not typed
    """vLLM-Omni's connector interface over an omni-plugins backend (see :mod:`omni_plugins_vllm_omni.extra`)."""

    #: tensors and bytes travel as out-of-band buffers of omni-plugins' wire format, never through
    #: vLLM-Omni's serializer: its KV transfer manager then hands over packed bytes / a uint8 tensor
    supports_raw_data = True

    def __init__(self, config: dict[str, Any]) -> None:
        self._closed = True  # until the backend exists: close() (also from __del__) has nothing to do
        self.config = dict(config or {})
        self.settings: AdapterSettings = split_extra(self.config)
        if resolve_connector(self.settings.backend).name == BRIDGE_NAME:
            raise ValueError(f"extra.backend {self.settings.backend!r} would wrap vLLM-Omni's connectors in themselves")
        self.stage_id = self.settings.stage_id
        self._backend: Connector = create_connector(self.settings.backend, self.settings.backend_config)
        self._pending = PendingPuts()
        self._lock = threading.Lock()
        self._metrics = {"puts": 0, "gets": 0, "bytes_transferred": 0, "errors": 0, "cleaned": 0}
        self._closed = False
        log.debug(
            "%s connector (stage %s, role %s) on backend %r", CONNECTOR_NAME, self.stage_id, self.config.get("role"), self._backend.name
        )

    @property
    def backend(self) -> Connector:
        """The omni-plugins connector every call goes to."""
        return self._backend

    # -- data path ---------------------------------------------------------------------
    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        backend_key = edge_key(put_key, from_stage, to_stage)
        try:
            result = self._backend.put(from_stage, to_stage, backend_key, to_wire(data))
        except Exception as exc:
            self._count("errors")
            log.error(
                "%s put failed for %s (%s -> %s, backend %r): %s", CONNECTOR_NAME, put_key, from_stage, to_stage, self._backend.name, exc
            )
            return False, 0, None
        if not result.ok:
            self._count("errors")
            log.error("%s put of %s (%s -> %s) refused by backend %r", CONNECTOR_NAME, put_key, from_stage, to_stage, self._backend.name)
            return False, 0, None
        self._pending.add(put_key, backend_key)
        self._count("puts", result.size)
        return True, result.size, None  # no metadata: every get works from the key alone

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None) -> tuple[Any, int] | None:
        """Non-blocking; ``metadata`` (put's, or another transport's) is not needed and not read."""
        return self._get(from_stage, to_stage, get_key, None)

    def get_with_deadline(
        self, from_stage: str, to_stage: str, get_key: str, metadata: dict[str, Any] | None = None, *, deadline: float
    ) -> tuple[Any, int] | None:
        """A blocking get until ``deadline`` (``time.monotonic()``): the backend waits, nothing polls."""
        return self._get(from_stage, to_stage, get_key, max(0.0, deadline - time.monotonic()))

    def _get(self, from_stage: str, to_stage: str, get_key: str, timeout: float | None) -> tuple[Any, int] | None:
        backend_key = edge_key(get_key, from_stage, to_stage)
        try:
            result = self._backend.get(from_stage, to_stage, backend_key, timeout=timeout or None)
            if result is None:
                return None
            data = from_wire(result.data)
        except WireFormatError as exc:  # consumed and undecodable: retrying cannot help
            self._count("errors")
            log.error(
                "%s get of %s (%s -> %s): payload is corrupt and was discarded: %s", CONNECTOR_NAME, get_key, from_stage, to_stage, exc
            )
            return None
        except Exception as exc:
            self._count("errors")
            log.error(
                "%s get failed for %s (%s -> %s, backend %r): %s", CONNECTOR_NAME, get_key, from_stage, to_stage, self._backend.name, exc
            )
            return None
        self._pending.discard([backend_key])
        self._count("gets", result.size)
        return data, result.size

    # -- lifecycle ---------------------------------------------------------------------
    def cleanup(self, request_id: str) -> None:
        """Free what ``request_id`` left: every unconsumed payload this connector put for it (see
        :mod:`omni_plugins_vllm_omni.keys`), or the exact key ``request_id`` on this stage's edge."""
        backend_keys = self._pending.take_request(request_id)
        edge = (self.settings.injected.get("from_stage"), self.settings.injected.get("to_stage"))
        if not backend_keys and None not in edge:
            backend_keys = [edge_key(request_id, *edge)]
        for backend_key in backend_keys:
            try:
                if self._backend.cleanup(backend_key):
                    self._count("cleaned")
            except Exception as exc:
                self._count("errors")
                log.warning("%s cleanup of %s failed (left to the backend's expiry): %s", CONNECTOR_NAME, backend_key, exc)

    def reap_consumed(self) -> None:
        """Forget payloads other processes consumed, where the backend can tell (a backend without an
        existence check reports every key as possibly there: nothing is forgotten)."""
        keys = self._pending.snapshot()
        if keys and not self._closed:
            self._pending.keep_only(keys, lambda ks: self._backend.wait_any(ks, 0.0))

    def health(self) -> dict[str, Any]:
        status: dict[str, Any] = {"status": "healthy", "backend": self._backend.name if hasattr(self, "_backend") else None}
        with self._lock:
            status.update(self._metrics)
        status["pending"] = len(self._pending)
        if self._closed:
            return {**status, "status": "unhealthy", "error": "connector closed"}
        try:
            backend = self._backend.health()
        except Exception as exc:
            return {**status, "status": "unhealthy", "error": f"backend health failed: {exc}"}
        status["backend_health"] = backend
        if not backend.get("ok", False):
            status.update(status="unhealthy", error=str(backend.get("error", "backend reports not ok")))
        return status

    def close(self) -> None:
        """Close the backend connector. Idempotent; never raises (vLLM-Omni calls it from ``__del__``)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._backend.close()
        except Exception as exc:
            log.warning("%s: closing backend %r failed: %s", CONNECTOR_NAME, self._backend.name, exc)

    def _count(self, what: str, nbytes: int = 0) -> None:
        with self._lock:
            self._metrics[what] += 1
            if nbytes:
                self._metrics["bytes_transferred"] += nbytes
