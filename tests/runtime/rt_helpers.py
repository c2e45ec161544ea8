"""Helpers shared by the runtime tests (imported by path; not a package)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from omni_plugins import StageConfig
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime

FAST = RuntimeTuning(join_timeout_s=2.0, drain_timeout_s=2.0, retry_backoff_s=0.001)


def make_runtime(stage_id: int, namespace: str, *, connector: Connector | None = None, tuning: RuntimeTuning = FAST, **stage: Any):
    """A runtime for ``stage_id`` over the memory connector ``namespace`` (or ``connector``)."""
    cfg = StageConfig(stage_id=stage_id, **stage)
    if connector is not None:
        return StageTransferRuntime(cfg, connector=connector, tuning=tuning)
    return StageTransferRuntime(cfg, {"name": "memory", "extra": {"namespace": namespace}}, tuning=tuning)


class Req(SimpleNamespace):
    """A minimal request object as a model runner would pass it."""

    def __init__(self, request_id: str, external_req_id: str | None = None, **kw: Any) -> None:
        super().__init__(request_id=request_id, external_req_id=external_req_id, done=False, **kw)

    def is_finished(self) -> bool:
        return bool(self.done)


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.002) -> Any:
    """Poll ``pred`` until truthy (returns its value) or fail after ``timeout`` (not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def collect_until(rt: StageTransferRuntime, pred: Callable[[Any], bool], timeout: float = 5.0) -> list:
    """Collect signals until one satisfies ``pred``; returns every signals object seen."""
    seen: list = []

    def step() -> bool:
        sig = rt.collect_signals()
        seen.append(sig)
        return pred(sig)

    wait_until(step, timeout)
    return seen


class FlakyConnector(MemoryConnector):
    """Memory connector whose first ``fail_puts`` puts fail (``mode``: "refuse" -> ok=False, "raise")."""

    def __init__(self, namespace: str, fail_puts: int = 0, mode: str = "refuse", fail_keys: Callable[[str], bool] | None = None) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        self.fail_left = fail_puts
        self.mode = mode
        self.fail_keys = fail_keys or (lambda k: True)
        self.attempts: list[str] = []
        self.lock = threading.Lock()

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        with self.lock:
            self.attempts.append(key)
            fail = self.fail_left > 0 and self.fail_keys(key)
            if fail:
                self.fail_left -= 1
        if fail:
            if self.mode == "raise":
                raise RuntimeError(f"injected put failure for {key}")
            return PutResult(False, 0, {"error": "injected"})
        return super()._put(from_stage, to_stage, key, data)


class GatedConnector(MemoryConnector):
    """Memory connector whose puts block until ``gate`` is set (sends stay in flight)."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        self.entered.set()
        self.gate.wait(10)
        return super()._put(from_stage, to_stage, key, data)


class PollOnlyConnector(MemoryConnector):
    """Memory connector that does not advertise blocking gets (forces the polling path)."""

    capabilities = Capabilities(blocking_get=False, cross_process=False)


class RawConnector(MemoryConnector):
    """Memory connector that stores a raw object under a key without encoding (corrupt-payload injection)."""

    def inject_bad(self, key: str) -> None:
        with self._store.cond:
            self._store.items[key] = b"\x00not-a-wire-payload"
            self._store.nbytes += 19
            self._store.cond.notify_all()


__all__ = ["FAST", "FlakyConnector", "GatedConnector", "GetResult", "PollOnlyConnector", "RawConnector", "Req", "make_runtime"]
