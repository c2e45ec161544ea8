"""The receive thread: finds each registered request's next key and hands arrivals over.

Two ways to wait, chosen by :class:`RuntimeTuning.arrival`:

* **block** (connectors with ``capabilities.blocking_get``): sweep every
  registered key with a non-blocking ``get``; when nothing arrived, park in a
  blocking ``get`` on the request most likely to be next -- the one whose last
  arrival is oldest, which is the next one when a producer emits a chunk for
  every stream per model step -- for ``park`` seconds (growing while idle,
  reset on arrival), then sweep again.
* **poll**: sweep, then sleep with a bounded backoff (``poll_min_s`` growing
  to ``poll_max_s``, reset on arrival). A registration wakes the thread.

Every ``get`` has a timeout, so shutdown and a dead peer never hang the thread.
Deadlines (``recv_timeout_s`` since registration or the last arrival) are
checked on every sweep.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from omni_plugins.contract import Connector
from omni_plugins.errors import WireFormatError
from omni_plugins.runtime.state import RequestRegistry, RequestState
from omni_plugins.runtime.tuning import RuntimeTuning

logger = logging.getLogger(__name__)


class ArrivalHandler(Protocol):
    """What the receive thread calls, always under the registry lock."""

    def pollable(self, state: RequestState) -> bool: ...

    def recv_key(self, state: RequestState) -> str: ...

    def on_payload(self, state: RequestState, payload: Any) -> None: ...

    def on_failure(self, state: RequestState, *, timed_out: bool) -> list[str]:
        """Drop the request; return connector keys to clean (outside the lock)."""
        ...


class Receiver:
    """Owns the receive thread of one runtime."""

    def __init__(
        self,
        connector: Connector,
        registry: RequestRegistry,
        handler: ArrivalHandler,
        *,
        from_stage: int,
        to_stage: int,
        tuning: RuntimeTuning,
        name: str = "omni-recv",
    ) -> None:
        self._connector = connector
        self._registry = registry
        self._handler = handler
        self._from, self._to = from_stage, to_stage
        self._tuning = tuning
        mode = tuning.arrival
        if mode == "auto":
            mode = "block" if connector.capabilities.blocking_get else "poll"
        self.mode = mode
        self._consume = connector.capabilities.consume_on_get
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_error_log = 0.0
        self.stats = {"sweeps": 0, "gets": 0, "arrivals": 0, "parks": 0, "errors": 0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """Something was registered: look now."""
        self._wake.set()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("receive thread did not stop within %.1fs", timeout)

    # -- thread -----------------------------------------------------------------
    def _plan(self) -> list[tuple[RequestState, int, str]]:
        """Under the lock: expire deadlines, then list (state, index, key) to look for."""
        cleanup: list[str] = []
        batch: list[tuple[RequestState, int, str]] = []
        with self._registry.lock:
            now = time.monotonic()
            for state in self._registry.receiving():
                if state.deadline is not None and state.deadline <= now:
                    logger.warning(
                        "request %s waited more than its timeout for chunk %d; dropping it", state.request_id, state.next_recv_chunk
                    )
                    cleanup += self._handler.on_failure(state, timed_out=True)
                elif self._handler.pollable(state):
                    batch.append((state, state.next_recv_chunk, self._handler.recv_key(state)))
        self._cleanup(cleanup)
        return batch

    def _cleanup(self, keys: list[str]) -> None:
        """Free keys of a dropped request; they are sequential, so the first miss ends the scan."""
        for key in keys:
            if not self._cleanup_one(key):
                break

    def _cleanup_one(self, key: str) -> bool:
        try:
            return bool(self._connector.cleanup(key))
        except Exception:
            logger.debug("cleanup of %s failed", key, exc_info=True)
            return False

    def _run(self) -> None:
        t = self._tuning
        delay, park = t.poll_min_s, t.park_min_s
        while not self._stop.is_set():
            try:
                batch = self._plan()
                if not batch:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.stats["sweeps"] += 1
                progress = False
                for item in batch:
                    if self._stop.is_set():
                        return
                    progress = self._fetch(*item, timeout=None) or progress
                if progress:
                    delay, park = t.poll_min_s, t.park_min_s
                    continue
                if self.mode == "block":
                    target = min(batch, key=lambda b: b[0].last_arrival)
                    self.stats["parks"] += 1
                    park = t.park_min_s if self._fetch(*target, timeout=park) else min(park * 2, t.park_max_s)
                else:
                    self._wake.wait(delay)
                    self._wake.clear()
                    delay = min(delay * 2, t.poll_max_s)
            except Exception:  # never let the thread die
                logger.exception("receive loop error")
                self._stop.wait(t.poll_max_s)

    def _fetch(self, state: RequestState, index: int, key: str, *, timeout: float | None) -> bool:
        self.stats["gets"] += 1
        try:
            result = self._connector.get(self._from, self._to, key, timeout=timeout)
        except WireFormatError:
            logger.error("payload under %s cannot be decoded; request %s reported failed", key, state.request_id, exc_info=True)
            with self._registry.lock:
                keys = self._handler.on_failure(state, timed_out=False) if self._current(state, index) else []
            self._cleanup_one(key)
            self._cleanup(keys)
            return True
        except Exception:
            self.stats["errors"] += 1
            now = time.monotonic()
            if now - self._last_error_log > 1.0:
                self._last_error_log = now
                logger.warning("get of %s failed (retrying until the request times out)", key, exc_info=True)
            return False
        if result is None:
            return False
        if not self._consume:
            self._cleanup_one(key)
        self.stats["arrivals"] += 1
        with self._registry.lock:
            if self._current(state, index):
                self._handler.on_payload(state, result.data)
            else:
                logger.debug("dropping %s: request %s is gone or moved on", key, state.request_id)
        return True

    def _current(self, state: RequestState, index: int) -> bool:
        return state.registered and state.next_recv_chunk == index and self._registry.get(state.request_id) is state
