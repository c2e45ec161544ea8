"""Removing consumed store objects off the reader's critical path.

A consuming ``get`` must delete the object it read, and that is one master RPC
(0.1-0.3 ms on loopback, a third of a 1 MiB read's fixed cost). :class:`Remover`
does it on a background thread instead: ``get`` hands the key over and returns,
and keys handed over meanwhile are removed together with one ``batch_remove``.

Until its removal has finished a key is *pending*: the owning connector treats it
as already gone (its ``get`` returns None) and settles it first when it puts or
cleans up the same key again, so a re-put in the same process is never deleted
by a late removal. ``close`` (and ``flush``) wait for every pending removal, so
no object outlives the connector that consumed it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

RemoveOne = Callable[[str], int]
RemoveMany = Callable[[list[str]], list[int]]
OnFailure = Callable[[str, int], None]

_QUEUED, _REMOVING = 0, 1


class Remover:
    """A daemon thread that removes handed-over keys, one state per key (queued or being removed)."""

    def __init__(self, remove_one: RemoveOne, remove_many: RemoveMany, on_failure: OnFailure, *, name: str) -> None:
        self._remove_one = remove_one
        self._remove_many = remove_many
        self._on_failure = on_failure
        self._keys: dict[str, int] = {}  # key -> _QUEUED | _REMOVING
        self._queued = 0
        self._lock = threading.Lock()
        self._removed = threading.Condition(self._lock)  # notified when keys leave _keys
        # Wake-ups for the thread: a C-level queue, because ``submit`` runs right after a
        # read, when caches are cold, and Condition.notify's Python code cost tens of us there.
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str) -> None:
        """Remove ``key`` soon (it was consumed)."""
        with self._lock:
            stopped = self._stopping
            if not stopped and key not in self._keys:
                self._keys[key] = _QUEUED
                self._queued += 1
        if stopped:  # closing: nobody will drain the queue any more
            self._remove_now(key)
        else:
            self._wake.put(None)

    def pending(self, key: str) -> bool:
        """True while ``key``'s removal has not finished."""
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def settle(self, key: str, timeout: float = 30.0) -> bool:
        """Finish ``key``'s removal before returning (now, in this thread, if still queued); True when it was pending."""
        if key not in self._keys:  # the usual case (every put): no lock (a dict lookup is atomic)
            return False
        with self._lock:
            state = self._keys.get(key)
            if state is None:
                return False
            if state == _REMOVING:
                self._removed.wait_for(lambda: key not in self._keys, timeout)
                return True
            self._keys[key] = _REMOVING  # still pending for other threads until it is gone
            self._queued -= 1
        try:
            self._remove_now(key)
        finally:
            with self._lock:
                self._keys.pop(key, None)
                self._removed.notify_all()
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every handed-over key is removed; False on timeout."""
        with self._lock:
            return self._removed.wait_for(lambda: not self._keys, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Remove what is pending, then stop the thread."""
        deadline = time.monotonic() + timeout
        if not self.flush(timeout):
            logger.warning("%s: %d consumed object(s) still being removed at close", self._thread.name, len(self._keys))
        with self._lock:
            self._stopping = True
        self._wake.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))

    # -- internals --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.get()
            while True:  # drain: one wake-up may stand for several submits
                with self._lock:
                    if not self._queued:
                        if self._stopping:
                            return  # stopping and nothing left
                        break
                    batch = [k for k, state in self._keys.items() if state == _QUEUED]
                    for key in batch:
                        self._keys[key] = _REMOVING
                    self._queued = 0
                self._remove_batch(batch)

    def _remove_batch(self, batch: list[str]) -> None:
        try:
            codes = [self._remove_one(batch[0])] if len(batch) == 1 else list(self._remove_many(batch))
        except Exception:
            logger.exception("%s: removing %d consumed object(s) failed", self._thread.name, len(batch))
            codes = [-1] * len(batch)
        with self._lock:
            for key in batch:
                self._keys.pop(key, None)
            self._removed.notify_all()
        for key, code in zip(batch, codes, strict=False):
            if code != 0:
                self._on_failure(key, int(code))

    def _remove_now(self, key: str) -> None:
        try:
            code = int(self._remove_one(key))
        except Exception:
            logger.exception("%s: removing consumed key %r failed", self._thread.name, key)
            code = -1
        if code != 0:
            self._on_failure(key, code)
