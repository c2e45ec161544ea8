"""The receive thread over ``connector.wait_any`` (block mode, connectors with the capability).

Unit level: memory-connector subclasses that count calls, give wrong hints or
never notify (fault injection). Real shm across processes: ``test_multiprocess``
and ``tests/shm/test_wait_any.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from rt_helpers import FAST, Req, collect_until, make_runtime, wait_until

from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.errors import ConnectorClosedError
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import RuntimeTuning

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}


class CountingConnector(MemoryConnector):
    """Memory connector recording every wait_any and the keys it waited on."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        self.waited: list[int] = []
        self.blocking_gets = 0

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        self.waited.append(len(keys))
        return super()._wait_any(keys, timeout)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        if timeout:
            self.blocking_gets += 1
        return super()._get(from_stage, to_stage, key, timeout)


class LyingConnector(MemoryConnector):
    """wait_any reports every key at once, present or not (a wrong hint)."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        return list(keys)


class DeafConnector(MemoryConnector):
    """wait_any never sees anything (a lost notification): only the safety sweep finds arrivals."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        time.sleep(timeout)
        return []


def _stream(c: Any, p: Any, n: int, chunks: int, *, reverse: bool = True) -> dict[str, list[int]]:
    """Send ``chunks`` chunks to ``n`` streams (request order reversed per round); return what arrived per stream."""
    reqs = [Req(f"r{i}") for i in range(n)]
    for r in reqs:
        c.register_chunk_recv(Req(r.request_id))
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finished: set[str] = set()
    for k in range(chunks):
        for r in reversed(reqs) if reverse else reqs:
            r.done = k == chunks - 1
            p.send_chunk(r, {"ids": {"prompt": [k]}})
    deadline = time.monotonic() + 20
    while len(finished) < n and time.monotonic() < deadline:
        c.wait_ready(0.05)
        for rid in c.recv_chunk():
            got[rid] = list(c.get_local_stage_payload(rid)["ids"]["prompt"])
        sig = c.collect_signals()
        assert not sig.failed and not sig.timed_out
        finished |= sig.chunk_finished
    assert finished == set(got)
    for rid in got:
        c.cleanup_finished_request(rid)
        p.cleanup_finished_request(rid)
    return got


def test_block_mode_waits_on_every_pending_key(runtimes: list, namespace: str) -> None:
    conn = CountingConnector(namespace)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    assert c.arrival_mode == "block" and c.debug_state()["arrival_waits_any"] is True
    got = _stream(c, p, 12, 4)
    assert all(v == [0, 1, 2, 3] for v in got.values())
    assert max(conn.waited) == 12  # one wait covers all twelve streams
    assert conn.blocking_gets == 0  # ready keys are taken with non-blocking gets
    stats = c.debug_state()["receiver"]
    assert stats["waits"] > 0 and stats["parks"] == 0
    assert c.active_request_count() == 0 and conn.keys() == []


def test_wrong_hints_still_deliver_everything(runtimes: list, namespace: str) -> None:
    conn = LyingConnector(namespace)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    c.register_chunk_recv(Req("idle"))  # nothing ever arrives for it: every wait is (partly) a wrong hint
    time.sleep(0.05)
    assert c.debug_state()["receiver"]["wait_spurious"] > 0
    got = _stream(c, p, 6, 3)
    assert all(v == [0, 1, 2] for v in got.values())
    c.cleanup_finished_request("idle")
    assert c.active_request_count() == 0 and conn.keys() == []


def test_safety_sweep_finds_arrivals_a_connector_never_reported(runtimes: list, namespace: str) -> None:
    conn = DeafConnector(namespace)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    got = _stream(c, p, 4, 3)
    assert all(v == [0, 1, 2] for v in got.values())
    stats = c.debug_state()["receiver"]
    assert stats["wait_hits"] == 0 and stats["sweeps"] > 0
    assert conn.keys() == []


def test_tuning_keeps_park_one_mode(runtimes: list, namespace: str) -> None:
    conn = CountingConnector(namespace)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, tuning=RuntimeTuning(**{**FAST.__dict__, "wait_any": False}), async_chunk=True)
    runtimes += [p, c]
    assert c.arrival_mode == "block" and c.debug_state()["arrival_waits_any"] is False
    got = _stream(c, p, 6, 3)
    assert all(v == [0, 1, 2] for v in got.values())
    assert conn.waited == []


def test_deadline_fires_while_waiting(runtimes: list, namespace: str) -> None:
    c = make_runtime(1, namespace, async_chunk=True, recv_timeout_s=0.3)
    runtimes.append(c)
    c.register_chunk_recv(Req("late"))
    deadline = time.monotonic() + 10
    timed_out: set[str] = set()
    while not timed_out and time.monotonic() < deadline:
        c.wait_ready(0.05)
        timed_out |= c.collect_signals().timed_out
    assert timed_out == {"late"}


# -- the contract's fallback for connectors without the capability ------------------------
class _Plain(Connector):
    capabilities = Capabilities()

    def __init__(self) -> None:
        super().__init__()
        self.items: dict[str, Any] = {}

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        self.items[key] = data
        return PutResult(True, 1)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        return GetResult(self.items.pop(key), 1) if key in self.items else None

    def _cleanup(self, key: str) -> bool:
        return self.items.pop(key, None) is not None


class _WithExists(_Plain):
    def _available(self, keys: Sequence[str]) -> list[str] | None:
        return [k for k in keys if k in self.items]


def test_fallback_without_existence_check_reports_every_key() -> None:
    conn = _Plain()
    assert conn.wait_any(["a", "b"], timeout=0.01) == ["a", "b"]  # cannot know: every key is possible
    assert conn.wait_any([], timeout=0.01) == []


def test_fallback_with_existence_check_polls() -> None:
    conn = _WithExists()
    assert conn.wait_any(["a", "b"], timeout=0.02) == []
    timer = threading.Timer(0.05, lambda: conn.put(0, 1, "b", torch.ones(1)))
    timer.start()
    try:
        assert conn.wait_any(["a", "b"], timeout=10) == ["b"]
    finally:
        timer.join()


def test_wait_any_after_close_raises(namespace: str) -> None:
    conn = MemoryConnector(MemoryConfig(namespace=namespace))
    conn.close()
    with pytest.raises(ConnectorClosedError):
        conn.wait_any(["k"], timeout=0.01)


class BrokenWaitConnector(MemoryConnector):
    """wait_any always fails (a backend error): the thread must survive and the safety sweep deliver."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        raise RuntimeError("backend down")


def test_failing_wait_any_does_not_kill_the_thread(runtimes: list, namespace: str) -> None:
    conn = BrokenWaitConnector(namespace)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    got = _stream(c, p, 3, 2)
    assert all(v == [0, 1] for v in got.values())
    assert c.debug_state()["receiver"]["errors"] > 0


def test_waited_set_follows_registrations_arrivals_and_finishes(runtimes: list, namespace: str) -> None:
    """The waited set is kept between waits: a new registration joins it, an arrival moves its
    request to the next key, a finished stream leaves it."""
    conn = CountingConnector(namespace)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    a, b = Req("a"), Req("b")
    c.register_chunk_recv(Req("a"))

    def receive(rid: str, n: int) -> None:
        def arrived() -> bool:
            c.recv_chunk()
            c.collect_signals()
            payload = c.get_local_stage_payload(rid)
            return payload is not None and len(payload["ids"]["prompt"]) == n

        deadline = time.monotonic() + 10
        while not arrived():
            assert time.monotonic() < deadline, f"{rid} chunk {n - 1} never arrived"
            c.wait_ready(0.05)

    p.send_chunk(a, {"ids": {"prompt": [0]}})
    receive("a", 1)
    c.register_chunk_recv(Req("b"))
    p.send_chunk(b, {"ids": {"prompt": [0]}})
    receive("b", 1)
    p.send_chunk(a, {"ids": {"prompt": [1]}})  # a moved on to its next key
    receive("a", 2)
    assert 2 in conn.waited
    a.done = True
    p.send_chunk(a, {"ids": {"prompt": [2]}})
    receive("a", 3)
    mark = len(conn.waited)
    deadline = time.monotonic() + 10
    while len(conn.waited) < mark + 3:  # a few more waits: only b is left in them
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert set(conn.waited[mark + 1 :]) == {1}
    b.done = True
    p.send_chunk(b, {"ids": {"prompt": [1]}})
    receive("b", 2)
    for rid in ("a", "b"):
        c.cleanup_finished_request(rid)
        p.cleanup_finished_request(rid)
    assert c.active_request_count() == 0 and conn.keys() == []


def test_timeout_wakes_an_idle_model_thread(runtimes: list, namespace: str) -> None:
    """A timed-out request wakes ``wait_ready`` even when there is nothing to clean in the connector."""
    tuning = RuntimeTuning(**{**FAST.__dict__, "abort_scan_limit": 0})
    c = make_runtime(1, namespace, tuning=tuning, async_chunk=True, recv_timeout_s=0.2)
    runtimes.append(c)
    c.register_chunk_recv(Req("late"))
    assert c.wait_ready(10)
    assert c.collect_signals().timed_out == {"late"}
    assert c.active_request_count() == 0


class GatedConnector(MemoryConnector):
    """Reports its keys in sorted order; the get of ``gate_key`` signals ``entered`` and waits for ``release``."""

    def __init__(self, namespace: str, gate_key: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        self.gate_key = gate_key
        self.entered = threading.Event()
        self.release = threading.Event()

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        return sorted(super()._wait_any(keys, timeout))

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        if key == self.gate_key:
            self.entered.set()
            self.release.wait(10)  # bounded: a broken runtime fails the assertions, it does not hang
        return super()._get(from_stage, to_stage, key, timeout)


def _publish_first_chunks(conn: Connector, ids: list[str]) -> None:
    for rid in ids:
        conn.put(0, 1, f"{rid}_0_0", {"ids": {"prompt": [1]}, "meta": {"finished": True}})


def test_a_reported_chunk_goes_over_before_the_next_get_when_the_model_thread_is_idle(runtimes: list, namespace: str) -> None:
    """One wait reports a_0_0 and b_0_0; b's get blocks. a must reach the model thread meanwhile
    (not after b's get, as when every reported key was taken before any was delivered)."""
    conn = GatedConnector(namespace, gate_key="b_0_0")
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes.append(c)
    _publish_first_chunks(conn, ["a", "b"])
    for rid in ("a", "b"):
        c.register_chunk_recv(Req(rid))
    try:
        assert conn.entered.wait(10)
        assert c.wait_ready(10)
        assert set(c.recv_chunk()) == {"a"}  # b is still being fetched
        assert c.collect_signals().chunk_ready == {"a"}
    finally:
        conn.release.set()
    seen: set[str] = set()
    deadline = time.monotonic() + 10
    while "b" not in seen and time.monotonic() < deadline:
        c.wait_ready(0.05)
        seen |= set(c.recv_chunk())
        c.collect_signals()
    assert seen == {"b"}
    for rid in ("a", "b"):
        c.cleanup_finished_request(rid)
    assert c.active_request_count() == 0 and conn.keys() == []


def test_chunks_gather_while_the_model_thread_has_unread_ones(runtimes: list, namespace: str) -> None:
    """a is delivered at once; the model thread does not read it, so b (taken while a is unread)
    waits for c and both go over together after c's get."""
    conn = GatedConnector(namespace, gate_key="c_0_0")
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes.append(c)
    _publish_first_chunks(conn, ["a", "b", "c"])
    for rid in ("a", "b", "c"):
        c.register_chunk_recv(Req(rid))
    try:
        assert conn.entered.wait(10)  # a and b were taken, c's get is running
        assert c.get_local_stage_payload("a") is not None
        assert c.get_local_stage_payload("b") is None  # gathered, not yet delivered
    finally:
        conn.release.set()
    wait_until = time.monotonic() + 10
    while c.get_local_stage_payload("c") is None and time.monotonic() < wait_until:
        time.sleep(0.002)
    assert set(c.recv_chunk()) == {"a", "b", "c"}
    assert c.collect_signals().chunk_finished == {"a", "b", "c"}
    for rid in ("a", "b", "c"):
        c.cleanup_finished_request(rid)
    assert c.active_request_count() == 0 and conn.keys() == []


class StretchedWaitConnector(MemoryConnector):
    """Blocks every ``wait_any`` 300x its bound (unless interrupted or a waited key lands); records bounds and interrupts."""

    def __init__(self, namespace: str, *, interruptible: bool) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        if not interruptible:
            self.capabilities = Capabilities(blocking_get=True, wait_any=True)
        self.bounds: list[float] = []
        self.interrupts = 0
        self.waiting: list[str] = []

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        self.bounds.append(timeout)
        self.waiting = list(keys)
        return super()._wait_any(keys, timeout * 300)

    def _interrupt_wait(self) -> None:
        self.interrupts += 1
        super()._interrupt_wait()


def test_registration_interrupts_a_long_wait(runtimes: list, namespace: str) -> None:
    """With ``capabilities.interrupt_wait`` the receive thread waits with the long bound, and a
    registration cuts the wait short: a request registered while the thread waits (30 s here) on
    another key alone is received at once."""
    conn = StretchedWaitConnector(namespace, interruptible=True)
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes += [p, c]
    assert c.debug_state()["arrival_wait_interruptible"] is True
    c.register_chunk_recv(Req("a"))
    wait_until(lambda: conn.waiting == ["a_0_0"])
    assert max(conn.bounds) > 0.05  # the long bound
    before = conn.interrupts
    c.register_chunk_recv(Req("b"))
    assert conn.interrupts > before
    b = Req("b")
    b.done = True
    p.send_chunk(b, {"ids": {"prompt": [7]}})
    sigs = collect_until(c, lambda s: "b" in s.chunk_finished, timeout=10)  # << the 30 s the wait would block
    assert any("b" in s.chunk_ready for s in sigs)
    assert c.get_local_stage_payload("b")["ids"]["prompt"] == [7]
    for rid in ("a", "b"):
        c.cleanup_finished_request(rid)
        p.cleanup_finished_request(rid)
    assert c.active_request_count() == 0 and conn.keys() == []


def test_without_interrupt_the_wait_bound_stays_short(runtimes: list, namespace: str) -> None:
    conn = StretchedWaitConnector(namespace, interruptible=False)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes.append(c)
    assert c.debug_state()["arrival_wait_interruptible"] is False
    c.register_chunk_recv(Req("a"))
    wait_until(lambda: conn.bounds)
    c.register_chunk_recv(Req("b"))
    wait_until(lambda: sorted(conn.waiting) == ["a_0_0", "b_0_0"], timeout=10)
    assert max(conn.bounds) <= 0.01 and conn.interrupts == 0
    for rid in ("a", "b"):
        c.cleanup_finished_request(rid)


def test_generation_worker_interrupts_only_when_a_request_may_be_pollable_again(runtimes: list, namespace: str) -> None:
    """``collect_signals`` on a generation worker interrupts the wait only when it drained a wake-up
    or metadata (a request that may take its next chunk now), not on every call."""
    conn = StretchedWaitConnector(namespace, interruptible=True)
    c = make_runtime(1, namespace, connector=conn, async_chunk=True, worker_type="generation")
    runtimes.append(c)
    c.register_chunk_recv(Req("g"))
    wait_until(lambda: conn.waiting == ["g_0_0"])
    before = conn.interrupts
    for _ in range(5):
        assert not c.collect_signals()
    assert conn.interrupts == before
    c.cleanup_finished_request("g")
