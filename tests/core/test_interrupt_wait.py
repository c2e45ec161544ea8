"""The optional ``interrupt_wait`` capability of the connector contract (memory connector; base default).

Liveness is checked with generous joins against much longer wait bounds (a
wait that was not interrupted would still be blocked), never by timing.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from omni_plugins import create_connector
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.memory import MemoryConnector

#: a wait bound no test waits out: a waiter still blocked after a join of ``_JOIN_S`` was not interrupted
_LONG_S = 120.0
_JOIN_S = 20.0


class _Waiter:
    """``conn.wait_any(keys, _LONG_S)`` on a thread; ``result`` once it returned."""

    def __init__(self, conn: Connector, keys: Sequence[str]) -> None:
        self.result: list[str] | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(conn, list(keys)), daemon=True)
        self._thread.start()
        self.started.wait(_JOIN_S)

    def _run(self, conn: Connector, keys: list[str]) -> None:
        self.started.set()
        self.result = conn.wait_any(keys, _LONG_S)

    def join(self, timeout: float = _JOIN_S) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


@pytest.fixture
def memory() -> Any:
    ns = {"namespace": f"intr-{uuid.uuid4().hex}"}
    conns: list[Connector] = []

    def make() -> Connector:
        conns.append(create_connector("memory", ns))
        return conns[-1]

    yield make
    for c in conns:
        c.close()


def test_capability_defaults_off_and_memory_has_it() -> None:
    assert Capabilities().interrupt_wait is False
    assert MemoryConnector.capabilities.interrupt_wait is True


def test_blocked_wait_returns_when_interrupted(memory: Any) -> None:
    conn = memory()
    waiter = _Waiter(conn, ["never"])
    # the interrupt may land before or while the thread blocks: either way the wait must end
    conn.interrupt_wait()
    assert waiter.join(), "wait_any was not interrupted"
    assert waiter.result == []


def test_interrupt_before_the_wait_is_not_lost(memory: Any) -> None:
    conn = memory()
    conn.interrupt_wait()
    waiter = _Waiter(conn, ["never"])
    assert waiter.join(), "a pending interrupt did not end the next wait"
    assert waiter.result == []


def test_pending_interrupts_are_not_counted(memory: Any) -> None:
    conn = memory()
    conn.interrupt_wait()
    conn.interrupt_wait()
    assert _Waiter(conn, ["k"]).join()
    second = _Waiter(conn, ["k"])  # the first wait consumed the (single) pending interrupt
    assert not second.join(0.2), "a second wait returned without an interrupt or a key"
    assert conn.put(0, 1, "k", {"x": 1}).ok
    assert second.join()
    assert second.result == ["k"]
    assert conn.get(0, 1, "k") is not None  # hint only: nothing consumed by the wait


def test_interrupt_reaches_only_its_own_instance(memory: Any) -> None:
    a, b = memory(), memory()
    waiter_b = _Waiter(b, ["k"])
    a.interrupt_wait()
    assert not waiter_b.join(0.2), "another instance's interrupt ended this wait"
    assert a.put(0, 1, "k", {"x": 1}).ok
    assert waiter_b.join()
    assert waiter_b.result == ["k"]
    # a's pending interrupt ends a's next wait at once, even with the key present (found keys are returned)
    assert a.wait_any(["k"], _LONG_S) == ["k"]


def test_close_ends_a_blocked_wait_and_interrupt_after_close_is_harmless(memory: Any) -> None:
    conn = memory()
    waiter = _Waiter(conn, ["never"])
    conn.close()
    assert waiter.join()
    conn.interrupt_wait()  # never raises, also on a closed connector


class _NoInterrupt(Connector):
    """A connector without the capability: the base ``interrupt_wait`` must be a harmless no-op."""

    capabilities = Capabilities(wait_any=True)

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        return PutResult(True, 0)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        return None

    def _cleanup(self, key: str) -> bool:
        return False

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        self.waits += 1
        return []


def test_without_the_capability_interrupt_is_a_no_op() -> None:
    conn = _NoInterrupt()
    conn.interrupt_wait()
    assert conn.wait_any(["k"], 0.0) == []
    assert conn.waits == 1
    conn.close()
    conn.interrupt_wait()
