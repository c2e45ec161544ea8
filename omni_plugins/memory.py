"""The in-process reference connector (``memory``).

Payloads are encoded with :mod:`omni_plugins.wire` on ``put`` and decoded to
owned tensors on ``get``, exactly as a real backend would, so a pipeline that
works here works over shared memory or Redis. Instances with the same
``namespace`` in one process share one store; nothing crosses processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from collections.abc import Set as AbstractSet
from typing import Any, ClassVar

from pydantic import Field

from omni_plugins import wire
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.settings import ConnectorSettings


class MemoryConfig(ConnectorSettings):
    """Config of the in-process reference connector."""

    namespace: str = Field(default="default", min_length=1, description="instances with the same namespace share payloads")
    max_bytes: int = Field(default=1 << 34, gt=0, description="refuse a put that would exceed this many stored bytes")


class _Store:
    """One namespace's payloads, guarded by a condition so ``get`` can block."""

    def __init__(self) -> None:
        self.items: dict[str, bytes] = {}
        #: the instance (its token) that put each stored key: a closing instance frees its own unread payloads
        self.owners: dict[str, object] = {}
        self.nbytes = 0
        self.cond = threading.Condition()


class MemoryConnector(Connector):
    """In-process connector: the reference implementation of the contract."""

    capabilities = Capabilities(blocking_get=True, cross_process=False, wait_any=True, interrupt_wait=True, wait_any_sets=True)
    config_model = MemoryConfig
    _stores: ClassVar[dict[str, _Store]] = {}
    _stores_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, config: MemoryConfig | None = None) -> None:
        super().__init__()
        self.config = config or MemoryConfig()
        with self._stores_lock:
            self._store = self._stores.setdefault(self.config.namespace, _Store())
        self._token = object()  # identifies this instance's payloads in the shared store
        self._interrupted = False  # interrupt_wait() pending: the (next) wait_any of this instance returns

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        blob = wire.encode(data).to_bytes()
        with self._store.cond:
            result = self._store_locked(key, blob)
            self._store.cond.notify_all()
        return result

    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        """Encode once; every key holds the same immutable bytes (a full namespace fails the targets that do not fit)."""
        blob = wire.encode(data).to_bytes()
        with self._store.cond:
            results = [self._store_locked(key, blob) for _, _, key in targets]
            self._store.cond.notify_all()
        return results

    def _store_locked(self, key: str, blob: bytes) -> PutResult:
        store = self._store
        old = store.items.get(key)
        new_total = store.nbytes - (len(old) if old else 0) + len(blob)
        if new_total > self.config.max_bytes:
            return PutResult(False, len(blob), {"error": f"namespace {self.config.namespace!r} is full"})
        store.items[key] = blob
        store.owners[key] = self._token
        store.nbytes = new_total
        return PutResult(True, len(blob), None)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._store.cond:
            while key not in self._store.items:
                if deadline is None:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    return None
                self._store.cond.wait(min(remaining, 0.5))
            blob = self._store.items.pop(key)
            self._store.owners.pop(key, None)
            self._store.nbytes -= len(blob)
        return GetResult(wire.decode(blob, copy=True), len(blob))

    def _wait_any(self, keys: Collection[str], timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        # a set (or keys view) larger than the store: walk the store and look up in the set
        look_up = isinstance(keys, AbstractSet)
        with self._store.cond:
            while True:
                items = self._store.items
                found = [k for k in items if k in keys] if look_up and len(items) < len(keys) else [k for k in keys if k in items]
                remaining = deadline - time.monotonic()
                if found or remaining <= 0 or self.closed or self._interrupted:
                    self._interrupted = False
                    return found
                self._store.cond.wait(min(remaining, 0.5))

    def _interrupt_wait(self) -> None:
        with self._store.cond:
            self._interrupted = True
            self._store.cond.notify_all()

    def _cleanup(self, key: str) -> bool:
        with self._store.cond:
            blob = self._store.items.pop(key, None)
            if blob is not None:
                self._store.nbytes -= len(blob)
                self._store.owners.pop(key, None)
            return blob is not None

    def _health(self) -> dict[str, Any]:
        with self._store.cond:
            return {"namespace": self.config.namespace, "keys": len(self._store.items), "bytes": self._store.nbytes}

    def _close(self) -> None:
        with self._store.cond:
            mine = [key for key, owner in self._store.owners.items() if owner is self._token]
            for key in mine:
                del self._store.owners[key]
                blob = self._store.items.pop(key, None)
                if blob is not None:
                    self._store.nbytes -= len(blob)
            self._store.cond.notify_all()

    @classmethod
    def namespace_keys(cls, namespace: str) -> list[str]:
        """Keys stored in ``namespace`` in this process (none if it was never used)."""
        with cls._stores_lock:
            store = cls._stores.get(namespace)
        if store is None:
            return []
        with store.cond:
            return sorted(store.items)

    @classmethod
    def discard_namespace_keys(cls, namespace: str, prefix: str) -> int:
        """Remove the payloads of ``namespace`` whose key starts with ``prefix``; how many there were."""
        with cls._stores_lock:
            store = cls._stores.get(namespace)
        if store is None:
            return 0
        with store.cond:
            doomed = [k for k in store.items if k.startswith(prefix)]
            for key in doomed:
                store.nbytes -= len(store.items.pop(key))
                store.owners.pop(key, None)
            return len(doomed)

    def keys(self) -> list[str]:
        """Keys currently stored in this namespace (for leak checks)."""
        with self._store.cond:
            return sorted(self._store.items)
