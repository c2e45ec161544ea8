"""The send thread: ordering, retries at the front, drops after 3 retries, deferred cleanup."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from rt_helpers import FlakyConnector, GatedConnector, Req, make_runtime, wait_until

from omni_plugins.contract import PutResult
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import RuntimeTuning

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}


def _read_all(namespace: str, keys: list[str]) -> list:
    reader = MemoryConnector(MemoryConfig(namespace=namespace))
    out = []
    for k in keys:
        got = reader.get("0", "1", k)
        out.append(None if got is None else got.data)
    return out


@pytest.mark.parametrize("mode", ["refuse", "raise"])
def test_failed_put_is_retried_in_order(mode: str, runtimes: list, namespace: str) -> None:
    conn = FlakyConnector(namespace, fail_puts=3, mode=mode, fail_keys=lambda k: k == "r_0_1")
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    for i in range(4):
        p.send_chunk(Req("r"), {"ids": {"prompt": [i]}})
    assert p.wait_sends()
    # chunk 1 failed three times and was retried at the front: chunk 2 was never put before it
    assert conn.attempts == ["r_0_0", "r_0_1", "r_0_1", "r_0_1", "r_0_1", "r_0_2", "r_0_3"]
    got = _read_all(namespace, [f"r_0_{i}" for i in range(4)])
    assert [g["ids"]["prompt"] for g in got] == [[0], [1], [2], [3]]
    assert not p.collect_signals().failed


def test_put_dropped_after_three_retries_and_reported(runtimes: list, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    conn = FlakyConnector(namespace, fail_puts=100, fail_keys=lambda k: k == "r_0_0")
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("r"), {"x": [0]})
    p.send_chunk(Req("r"), {"x": [1]})
    assert p.wait_sends()
    assert conn.attempts.count("r_0_0") == 4  # first try + 3 retries
    assert any("giving up on r_0_0" in r.getMessage() for r in caplog.records)
    assert p.collect_signals().failed == {"r"}
    assert p.debug_state()["requests"]["r"]["in_flight"] == 0
    assert p.debug_state()["sender"]["dropped"] == 1
    assert _read_all(namespace, ["r_0_1"])[0] == {"x": [1], "meta": {"finished": False}}


@pytest.mark.parametrize("verbose", [False, True])
def test_a_raising_put_is_one_line_unless_verbose(verbose: bool, runtimes: list, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO if verbose else logging.WARNING, logger="omni_plugins.runtime.sender")
    conn = FlakyConnector(namespace, fail_puts=1, mode="raise")
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("r"), {"x": [0]})
    assert p.wait_sends()
    [raised] = [r for r in caplog.records if "raised" in r.getMessage()]
    assert "RuntimeError: injected put failure for r_0_0" in raised.getMessage()
    assert bool(raised.exc_info) is verbose  # the traceback only with -v


def test_other_requests_are_not_blocked_by_a_failing_one(runtimes: list, namespace: str) -> None:
    conn = FlakyConnector(namespace, fail_puts=3, fail_keys=lambda k: k.startswith("bad_"))
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("bad"), {"x": [0]})
    p.send_chunk(Req("good"), {"x": [0]})
    assert p.wait_sends()
    assert conn.attempts.index("good_0_0") < len(conn.attempts) - 1  # good went out between bad's retries


def test_cleanup_is_deferred_while_sends_are_in_flight(runtimes: list, namespace: str) -> None:
    conn = GatedConnector(namespace)
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("r"), {"x": [0]})
    p.send_chunk(Req("r"), {"x": [1]})
    assert conn.entered.wait(5)
    assert p.cleanup_finished_request("r")
    state = p.debug_state()["requests"]["r"]
    assert state["released"] and state["in_flight"] == 2  # send-side state kept for the sends
    conn.gate.set()
    wait_until(lambda: p.active_request_count() == 0)
    assert sorted(conn.keys()) == ["r_0_0", "r_0_1"]  # both still delivered
    for k in ("r_0_0", "r_0_1"):
        conn.cleanup(k)


def test_concurrent_senders_keep_per_request_order(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    runtimes.append(p)

    def produce(rid: str) -> None:
        for i in range(20):
            p.send_chunk(Req(rid), {"ids": {"prompt": [i]}, "t": torch.ones(1)})

    threads = [threading.Thread(target=produce, args=(f"r{j}",)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.wait_sends()
    for j in range(4):
        got = _read_all(namespace, [f"r{j}_0_{i}" for i in range(20)])
        assert [g["ids"]["prompt"][0] for g in got] == list(range(20))


def test_many_threads_handing_chunks_over_keep_order_and_raise_nothing(runtimes: list, namespace: str) -> None:
    """Hand-overs from several threads at once share one signal: none may wake for another's chunk
    in a way that leaves the signal out of step (a later wait would hang or a release would raise)."""
    p = make_runtime(0, namespace, tuning=RuntimeTuning(join_timeout_s=2.0, drain_timeout_s=2.0, send_handoff_s=0.0003), **STREAM)
    runtimes.append(p)
    errors: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment,misc]
    try:

        def produce(rid: str) -> None:
            for i in range(80):
                p.send_chunk(Req(rid), {"ids": {"prompt": [i]}})

        threads = [threading.Thread(target=produce, args=(f"h{j}",)) for j in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert p.wait_sends()
    finally:
        threading.excepthook = hook
    assert errors == []
    stats = p.debug_state()["sender"]
    assert stats["handoffs"] > 0 and stats["puts"] == 640
    for j in range(8):
        got = _read_all(namespace, [f"h{j}_0_{i}" for i in range(80)])
        assert [g["ids"]["prompt"][0] for g in got] == list(range(80))


def test_send_chunk_returns_once_the_send_thread_took_the_chunk(runtimes: list, namespace: str) -> None:
    """With a hand-over bound (long here, so the test does not depend on timing) every send_chunk
    waits until the send thread picked its chunk: none waits in vain; without one nobody waits."""
    p = make_runtime(0, namespace, tuning=RuntimeTuning(join_timeout_s=2.0, send_handoff_s=2.0), **STREAM)
    off = make_runtime(0, namespace + "-0", tuning=RuntimeTuning(join_timeout_s=2.0, send_handoff_s=0.0), **STREAM)
    runtimes += [p, off]
    for i in range(3):
        p.send_chunk(Req("r"), {"x": [i]})
        off.send_chunk(Req("r"), {"x": [i]})
    assert p.wait_sends() and off.wait_sends()
    stats = p.debug_state()["sender"]
    assert (stats["handoffs"], stats["handoff_timeouts"]) == (3, 0)
    assert off.debug_state()["sender"]["handoffs"] == 0
    assert [g["x"] for g in _read_all(namespace, [f"r_0_{i}" for i in range(3)])] == [[0], [1], [2]]
    for i in range(3):
        MemoryConnector(MemoryConfig(namespace=namespace + "-0")).cleanup(f"r_0_{i}")


class _SlowConnector(MemoryConnector):
    """Memory connector whose puts take 30 ms (a slow backend)."""

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        time.sleep(0.03)
        return super()._put(from_stage, to_stage, key, data)


def test_no_hand_over_while_puts_are_slower_than_its_bound(runtimes: list, namespace: str) -> None:
    """Once puts are known to take longer than send_handoff_s, send_chunk stops waiting for them."""
    conn = _SlowConnector(MemoryConfig(namespace=namespace))
    p = make_runtime(0, namespace, connector=conn, tuning=RuntimeTuning(join_timeout_s=2.0, send_handoff_s=0.005), **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("r"), {"x": [0]})  # no put measured yet: waits for the idle send thread
    assert p.wait_sends()
    for i in range(1, 5):
        p.send_chunk(Req("r"), {"x": [i]})
    assert p.wait_sends()
    assert p.debug_state()["sender"]["handoffs"] == 1
    assert sorted(conn.keys()) == [f"r_0_{i}" for i in range(5)]
    for i in range(5):
        conn.cleanup(f"r_0_{i}")


class _GatedFlaky(FlakyConnector):
    """Flaky connector whose first put waits for ``gate`` (so the next puts queue up behind it)."""

    def __init__(self, namespace: str, **kw: object) -> None:
        super().__init__(namespace, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _put(self, from_stage: str, to_stage: str, key: str, data: object):  # type: ignore[no-untyped-def]
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(10)
        return super()._put(from_stage, to_stage, key, data)


def test_batched_puts_keep_order_when_one_request_fails(runtimes: list, namespace: str) -> None:
    """Puts queued for several requests are taken together; a failure re-queues only its request, in order."""
    conn = _GatedFlaky(namespace, fail_puts=2, fail_keys=lambda k: k == "b_0_0")
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("first"), {"x": [0]})
    assert conn.entered.wait(5)  # the send thread is inside the first put: everything below queues up
    for i in range(3):
        for rid in ("a", "b", "c"):
            p.send_chunk(Req(rid), {"x": [i]})
    conn.gate.set()
    assert p.wait_sends()
    for rid in ("a", "b", "c"):
        mine = [k for k in conn.attempts if k.startswith(f"{rid}_")]
        expected = [f"{rid}_0_{i}" for i in range(3)]
        assert mine == (["b_0_0", "b_0_0", *expected] if rid == "b" else expected)
    # requests are served round-robin: a and c did not wait for b's retries to finish
    assert conn.attempts.index("a_0_0") < conn.attempts.index("b_0_1")
    assert conn.attempts.index("c_0_0") < conn.attempts.index("b_0_1")
    got = _read_all(namespace, [f"{rid}_0_{i}" for rid in ("first", "a", "b", "c") for i in range(3 if rid != "first" else 1)])
    assert all(g is not None for g in got)
    assert not p.collect_signals().failed
