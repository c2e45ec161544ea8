"""The connector contract every backend plugin implements.

A connector moves one payload per key between two stages. ``put`` stores, ``get``
retrieves (and by default consumes), ``cleanup`` frees a key that will never be
read, ``health`` reports status, ``close`` releases everything the instance owns.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

from omni_plugins.errors import ConnectorClosedError

StageId = int | str


class PutResult(NamedTuple):
    """Outcome of :meth:`Connector.put`: success, serialized size in bytes, optional metadata."""

    ok: bool
    size: int
    metadata: dict[str, Any] | None = None


class GetResult(NamedTuple):
    """Outcome of a successful :meth:`Connector.get`: the decoded payload and its serialized size."""

    data: Any
    size: int


@dataclass(frozen=True)
class Capabilities:
    """What a runtime may rely on beyond the basic contract.

    Attributes:
        blocking_get: ``get(..., timeout=t)`` waits for the key without the caller
            polling; a runtime should block on it instead of sleeping between polls.
        cross_process: a payload put in one process can be read in another.
        cross_host: a payload can cross machines.
        zero_copy_get: ``get`` can hand out views over backend memory.
        consume_on_get: a successful ``get`` removes the payload.
    """

    blocking_get: bool = False
    cross_process: bool = False
    cross_host: bool = False
    zero_copy_get: bool = False
    consume_on_get: bool = True


class Connector(abc.ABC):
    """Abstract base of all connectors.

    Subclasses implement the ``_put``/``_get``/``_cleanup``/``_close`` primitives;
    this class provides closed-state checking, idempotent ``close`` and the
    context-manager protocol. ``name`` is filled in by the registry.
    """

    name: str = "connector"
    capabilities: Capabilities = Capabilities()

    def __init__(self) -> None:
        self._closed = False
        self._close_lock = threading.Lock()

    # -- public contract ---------------------------------------------------
    def put(self, from_stage: StageId, to_stage: StageId, key: str, data: Any) -> PutResult:
        """Store ``data`` under ``key`` for the edge ``from_stage -> to_stage``."""
        self._check_open()
        return self._put(str(from_stage), str(to_stage), key, data)

    def get(self, from_stage: StageId, to_stage: StageId, key: str, *, timeout: float | None = None) -> GetResult | None:
        """Return the payload stored under ``key``, or None when it is absent.

        With ``timeout`` (seconds) wait up to that long for the key to arrive.
        """
        self._check_open()
        return self._get(str(from_stage), str(to_stage), key, timeout)

    def cleanup(self, key: str) -> bool:
        """Free the payload under ``key`` (if any). Returns True when something was freed."""
        self._check_open()
        return self._cleanup(key)

    def health(self) -> dict[str, Any]:
        """A JSON-able status dict; always contains ``ok`` and ``connector``."""
        if self._closed:
            return {"ok": False, "connector": self.name, "closed": True}
        status = {"ok": True, "connector": self.name}
        status.update(self._health())
        return status

    def close(self) -> None:
        """Release everything this instance owns. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- primitives for subclasses ----------------------------------------
    @abc.abstractmethod
    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult: ...

    @abc.abstractmethod
    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None: ...

    @abc.abstractmethod
    def _cleanup(self, key: str) -> bool: ...

    def _health(self) -> dict[str, Any]:
        return {}

    def _close(self) -> None:
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError(f"connector {self.name!r} is closed; create a new one")
