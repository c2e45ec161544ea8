"""The payloads one ``OmniPlugins`` connector put that nobody is known to have consumed.

vLLM-Omni's engine frees unconsumed chunks of an aborted request only for its own shared-memory
connector; for any other it relies on the backend (a TTL) or on ``cleanup``. This record lets
``cleanup(request_id)`` find every backend key the request left, whichever edge it was put on.
Consumers are other processes, so entries leave the record when ``reap_consumed`` finds their key
gone, when ``cleanup`` frees them, or, beyond :data:`LIMIT` entries, oldest first (the backend's own
expiry still frees those).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from omni_plugins_vllm_omni.keys import belongs_to

LIMIT = 65536


class PendingPuts:
    """vLLM-Omni key -> backend keys put under it (thread-safe, bounded)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()  # backend key, oldest first
        self._by_key: dict[str, set[str]] = {}  # vLLM-Omni key -> backend keys
        self._origin: dict[str, str] = {}  # backend key -> vLLM-Omni key
        self._limit = limit
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str, backend_key: str) -> None:
        with self._lock:
            self._keys[backend_key] = None
            self._keys.move_to_end(backend_key)
            self._by_key.setdefault(key, set()).add(backend_key)
            self._origin[backend_key] = key
            while len(self._keys) > self._limit:
                oldest, _ = self._keys.popitem(last=False)
                self._forget_locked(oldest)

    def discard(self, backend_keys: Iterable[str]) -> None:
        with self._lock:
            for backend_key in backend_keys:
                if backend_key in self._keys:
                    del self._keys[backend_key]
                    self._forget_locked(backend_key)

    def take_request(self, request_id: str) -> list[str]:
        """Remove and return the backend keys of every vLLM-Omni key of ``request_id`` (or equal to it)."""
        with self._lock:
            keys = [k for k in self._by_key if belongs_to(k, request_id)]
            taken = [b for k in keys for b in self._by_key.pop(k)]
            for backend_key in taken:
                self._keys.pop(backend_key, None)
                self._origin.pop(backend_key, None)
            return taken

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._keys)

    def keep_only(self, candidates: list[str], present: Callable[[list[str]], Iterable[str]]) -> None:
        """Forget those of ``candidates`` (a :meth:`snapshot`) that ``present`` does not report as still stored."""
        still = set(present(candidates))
        self.discard(k for k in candidates if k not in still)

    def _forget_locked(self, backend_key: str) -> None:
        key = self._origin.pop(backend_key, None)
        if key is None:
            return
        bucket = self._by_key.get(key)
        if bucket is not None:
            bucket.discard(backend_key)
            if not bucket:
                del self._by_key[key]
