"""Cleanup, prune, timeouts, corrupt payloads, shutdown: nothing of a request remains."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
import torch
from rt_helpers import FAST, RawConnector, Req, collect_until, make_runtime, wait_until

from omni_plugins.contract import GetResult
from omni_plugins.errors import TransientConnectorError
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import RuntimeTuning

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}


def test_cleanup_after_normal_stream_leaves_nothing(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True)
    runtimes += [p, c]
    reqs = [Req(f"i{n}", f"e{n}") for n in range(10)]
    for r in reqs:
        c.register_chunk_recv(Req(f"c{r.request_id}", r.external_req_id))
    for k in range(3):
        for r in reqs:
            r.done = k == 2
            p.send_chunk(r, {"embed": {"decode": torch.ones(1, 2)}})
    done: set[str] = set()
    collect_until(c, lambda s: done.update(s.chunk_finished) or len(done) == 10)
    p.wait_sends()
    for r in reqs:
        p.cleanup_finished_request(r.request_id)
        c.cleanup_finished_request(f"c{r.request_id}")
    assert p.active_request_count() == 0 and c.active_request_count() == 0
    assert c.debug_state()["receiving"] == [] and c.debug_state()["external_index"] == 0
    assert p.connector.keys() == []


def test_abort_mid_stream_frees_unread_chunks_in_the_connector(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True, worker_type="generation")
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    for i in range(5):
        p.send_chunk(Req("r"), {"codes": {"audio": [i]}})
    p.wait_sends()
    wait_until(c.recv_chunk)  # generation: one chunk taken, four wait in the connector
    assert len(p.connector.keys()) == 4
    assert c.cleanup_finished_request("r", aborted=True)
    assert p.connector.keys() == []
    assert c.active_request_count() == 0
    p.cleanup_finished_request("r")
    assert p.active_request_count() == 0


def test_cleanup_by_external_id(runtimes: list, namespace: str) -> None:
    c = make_runtime(1, namespace, async_chunk=True)
    runtimes.append(c)
    c.register_chunk_recv(Req("int", "ext"))
    assert c.cleanup_finished_request("ext")
    assert c.active_request_count() == 0
    assert not c.cleanup_finished_request("ext")


def test_cleanup_by_external_id_forgets_signals_under_the_internal_id(runtimes: list, namespace: str) -> None:
    bad = make_runtime(0, namespace, async_chunk=True, custom_process_next_stage_input_func="rt_builders.crashing")
    runtimes.append(bad)
    assert bad.send_chunk(Req("int", "ext"), {"x": 1}) is False  # reported failed under "int"
    assert bad.cleanup_finished_request("ext")
    assert bad.active_request_count() == 0
    assert not bad.collect_signals().failed  # nothing of the request is left, not even its pending report


def test_prune_keeps_a_request_active_under_its_external_id(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("int", "ext"), {"x": [1]})
    assert p.wait_sends()
    assert p.prune_inactive_requests({"ext"}) == set()
    assert p.active_request_count() == 1
    assert p.prune_inactive_requests(set()) == {"int"}
    assert p.active_request_count() == 0
    p.connector.cleanup("ext_0_0")


def test_prune_protects_waiting_and_undelivered(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace)
    c = make_runtime(1, namespace)
    runtimes += [p, c]
    c.register_chunk_recv(Req("waiting"))
    c.register_chunk_recv(Req("arrived"))
    p.send_full_payload_outputs({"arrived": {"x": [1]}})
    wait_until(lambda: c.debug_state()["requests"]["arrived"]["has_cached"])
    c.mark_kv_transfer("kv-only", 3, [0])
    assert c.prune_inactive_requests(set()) == {"kv-only"}
    assert {"waiting", "arrived"} <= set(c.debug_state()["requests"])
    assert c.recv_full_payload_inputs().keys() == {"arrived"}
    assert c.prune_inactive_requests(set()) == set()  # stage_recv not yet reported
    c.collect_signals()
    assert c.prune_inactive_requests({"waiting"}) == {"arrived"}
    assert set(c.debug_state()["requests"]) == {"waiting"}
    assert c.prune_inactive_requests(None) == set()


def test_wait_longer_than_timeout_is_reported_and_dropped(runtimes: list, namespace: str) -> None:
    c = make_runtime(1, namespace, async_chunk=True, recv_timeout_s=0.05)
    runtimes.append(c)
    c.register_chunk_recv(Req("slow"))
    seen = collect_until(c, lambda s: bool(s.timed_out))
    assert seen[-1].timed_out == {"slow"}
    assert c.active_request_count() == 0
    assert not c.collect_signals().timed_out  # reported once


def test_timeout_restarts_on_each_arrival(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True, recv_timeout_s=0.5)
    runtimes += [p, c]
    c.register_chunk_recv(Req("r"))
    req = Req("r")
    for _ in range(4):
        p.send_chunk(req, {"ids": {"prompt": [1]}})
        time.sleep(0.2)  # total 0.8 s > timeout, but never 0.5 s without an arrival
    sig = c.collect_signals()
    assert not sig.timed_out and "r" in c.debug_state()["requests"]


def test_undecodable_payload_fails_the_request(runtimes: list, namespace: str) -> None:
    conn = RawConnector(MemoryConfig(namespace=namespace))
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes.append(c)
    c.register_chunk_recv(Req("r"))
    conn.inject_bad("r_0_0")
    seen = collect_until(c, lambda s: bool(s.failed))
    assert seen[-1].failed == {"r"}
    assert c.active_request_count() == 0 and conn.keys() == []


class _GetReturnsTheData(MemoryConnector):
    """A plugin bug: ``_get`` returns the payload itself instead of a ``GetResult``."""

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> object:  # type: ignore[override]
        got = super()._get(from_stage, to_stage, key, timeout)
        return None if got is None else got.data


def test_a_get_that_breaks_the_contract_fails_the_request_at_once(runtimes: list, namespace: str) -> None:
    """Retrying a plugin bug returns the same wrong thing until the request's timeout (here 60 s): it fails now."""
    conn = _GetReturnsTheData(MemoryConfig(namespace=namespace))
    c = make_runtime(1, namespace, connector=conn, async_chunk=True, recv_timeout_s=60)
    runtimes.append(c)
    c.register_chunk_recv(Req("r"))
    conn.put(0, 1, "r_0_0", {"ids": {"prompt": [0]}, "meta": {"finished": False}})
    conn.put(0, 1, "r_0_1", {"ids": {"prompt": [1]}, "meta": {"finished": True}})
    seen = collect_until(c, lambda s: bool(s.failed or s.timed_out))
    assert seen[-1].failed == {"r"} and not seen[-1].timed_out
    assert c.active_request_count() == 0 and conn.keys() == []  # its later chunk is freed too


class _ShortOfDescriptors(MemoryConnector):
    """Fault injection: the first ``fail`` gets of a key that is there raise ``TransientConnectorError`` and leave
    it in place, as the shm connector's get does when its process is at its descriptor limit."""

    def __init__(self, config: MemoryConfig, fail: int) -> None:
        super().__init__(config)
        self.fail_left = fail
        self.lock = threading.Lock()

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        with self.lock:
            short = self.fail_left > 0 and key in self.keys()
            self.fail_left -= short
        if short:
            raise TransientConnectorError(f"get of {key!r}: cannot open its segment: Too many open files: raise ulimit -n")
        return super()._get(from_stage, to_stage, key, timeout)


@pytest.mark.parametrize(
    "tuning",
    [FAST, dataclasses.replace(FAST, arrival="block", wait_any=False), dataclasses.replace(FAST, arrival="poll")],
    ids=["wait-any", "park-one", "poll"],
)
def test_a_get_that_ran_short_of_a_resource_is_retried_and_delivers(tuning: RuntimeTuning, runtimes: list, namespace: str) -> None:
    """A ``TransientConnectorError`` does not fail the request (as an undecodable payload does): the chunk is
    looked for again, with backoff, and delivered once the get succeeds."""
    conn = _ShortOfDescriptors(MemoryConfig(namespace=namespace), fail=3)
    c = make_runtime(1, namespace, connector=conn, tuning=tuning, async_chunk=True, recv_timeout_s=60)
    runtimes.append(c)
    c.register_chunk_recv(Req("r"))
    conn.put(0, 1, "r_0_0", {"ids": {"prompt": [7]}, "meta": {"finished": True}})
    seen = collect_until(c, lambda s: bool(s.chunk_finished or s.failed or s.timed_out), timeout=30)
    assert seen[-1].chunk_finished == {"r"} and not seen[-1].failed and not seen[-1].timed_out
    payload: Any = c.get_local_stage_payload("r")
    assert payload["ids"]["prompt"] == [7]
    assert conn.fail_left == 0 and c.debug_state()["receiver"]["transient"] == 3
    assert conn.keys() == []


def test_undecodable_chunk_mid_stream_frees_the_chunks_after_it(runtimes: list, namespace: str) -> None:
    """Chunk 1 is consumed and unusable: the cleanup of the failed request starts at chunk 2 (a scan
    from chunk 1 would stop at once, it is gone, and leave chunk 2 behind)."""
    conn = RawConnector(MemoryConfig(namespace=namespace))
    conn.put(0, 1, "r_0_0", {"ids": {"prompt": [0]}, "meta": {"finished": False}})
    conn.inject_bad("r_0_1")
    conn.put(0, 1, "r_0_2", {"ids": {"prompt": [2]}, "meta": {"finished": True}})
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    runtimes.append(c)
    c.register_chunk_recv(Req("r"))
    collect_until(c, lambda s: bool(s.failed))
    assert c.active_request_count() == 0 and conn.keys() == []


def test_shutdown_stops_threads_and_closes_connector(namespace: str) -> None:
    c = make_runtime(1, namespace, async_chunk=True, tuning=RuntimeTuning(join_timeout_s=20.0))  # generous: a starved CI box is slow, not wrong
    c.register_chunk_recv(Req("r"))
    names = {t.name for t in threading.enumerate()}
    assert {"omni-send-stage1-r0", "omni-recv-stage1-r0"} <= names
    c.shutdown()
    c.shutdown()
    names = {t.name for t in threading.enumerate()}
    assert "omni-recv-stage1-r0" not in names and "omni-send-stage1-r0" not in names
    assert c.connector is not None and c.connector.closed
    assert c.send_chunk(Req("r"), {}) is False


def test_second_shutdown_is_a_no_op(namespace: str) -> None:
    class CountingClose(MemoryConnector):
        closes = 0

        def close(self) -> None:
            self.closes += 1
            super().close()

    conn = CountingClose(MemoryConfig(namespace=namespace))
    c = make_runtime(1, namespace, connector=conn, async_chunk=True)
    c.shutdown()
    c.shutdown()
    assert conn.closes == 1 and c.closed


def test_shutdown_lets_queued_sends_finish(namespace: str) -> None:
    p = make_runtime(0, namespace, tuning=FAST, **STREAM)
    from omni_plugins.memory import MemoryConnector

    reader = MemoryConnector(MemoryConfig(namespace=namespace))
    for i in range(50):
        p.send_chunk(Req("r"), {"t": torch.ones(64, 64), "i": [i]})
    p.connector.close = lambda: None  # keep the namespace readable after shutdown
    p.shutdown()
    assert len(reader.keys()) == 50
    for k in list(reader.keys()):
        reader.cleanup(k)


def test_many_requests_aborted_and_finished_leave_nothing(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True)
    runtimes += [p, c]
    for n in range(30):
        rid = f"r{n}"
        c.register_chunk_recv(Req(rid))
        req = Req(rid)
        req.done = n % 3 == 0
        p.send_chunk(req, {"ids": {"prompt": [n]}})
    p.wait_sends()
    for n in range(30):
        if n % 2:
            c.cleanup_finished_request(f"r{n}", aborted=True)
    even_finished = {f"r{n}" for n in range(30) if n % 2 == 0 and n % 3 == 0}
    wait_until(lambda: all(c.debug_state()["requests"][r]["stream_finished"] for r in even_finished))
    c.collect_signals()
    # finished and reported -> pruned; unfinished streams are still waiting -> protected
    assert c.prune_inactive_requests(set()) == even_finished
    for n in range(30):
        c.cleanup_finished_request(f"r{n}")
        p.cleanup_finished_request(f"r{n}")
    assert c.active_request_count() == 0 and p.active_request_count() == 0
    assert p.connector.keys() == []


def test_cleanup_survives_a_failing_flush(runtimes: list, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    p = make_runtime(0, namespace, custom_process_next_stage_input_func="rt_builders.whole", model_stage="t")
    runtimes.append(p)
    p.accumulate_full_payload_output("r", {"h": torch.ones(1, 2)}, Req("r"))

    def boom(ids: object) -> list:
        raise RuntimeError("backend exploded")

    p.flush_full_payload_outputs = boom  # type: ignore[method-assign]
    assert p.cleanup_finished_request("r") is True  # logged, not raised
    assert p.active_request_count() == 0
    assert any("during cleanup failed" in r.getMessage() for r in caplog.records)


def test_aborted_producer_frees_what_nobody_will_read(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    runtimes.append(p)
    for i in range(3):
        p.send_chunk(Req("r"), {"ids": {"prompt": [i]}})
    p.wait_sends()
    assert len(p.connector.keys()) == 3
    assert p.cleanup_finished_request("r", aborted=True)
    assert p.connector.keys() == [] and p.active_request_count() == 0


def test_aborted_producer_drops_queued_puts_and_purges_after_the_running_one(runtimes: list, namespace: str) -> None:
    from rt_helpers import GatedConnector

    conn = GatedConnector(namespace)
    p = make_runtime(0, namespace, connector=conn, **STREAM)
    runtimes.append(p)
    for i in range(4):
        p.send_chunk(Req("r"), {"ids": {"prompt": [i]}})
    assert conn.entered.wait(5)  # chunk 0 is being put, 1..3 queued
    p.cleanup_finished_request("r", aborted=True)
    state = p.debug_state()["requests"]["r"]
    assert state["queued_sends"] == 0 and state["in_flight"] == 1 and state["released"]
    conn.gate.set()
    wait_until(lambda: p.active_request_count() == 0)
    assert conn.keys() == []  # chunk 0 was put, then freed; 1..3 were never put
    assert p.debug_state()["sender"]["puts"] == 1


def test_normal_cleanup_keeps_chunks_for_the_consumer(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    runtimes.append(p)
    p.send_chunk(Req("r"), {"ids": {"prompt": [0]}})
    p.wait_sends()
    p.cleanup_finished_request("r")
    assert p.connector.keys() == ["r_0_0"]
    p.connector.cleanup("r_0_0")


class _CleanupOutage(MemoryConnector):
    """Memory connector whose ``cleanup`` raises while ``down`` is set (a backend restarting)."""

    def __init__(self, namespace: str) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        self.down = True

    def _cleanup(self, key: str) -> bool:
        if self.down:
            raise ConnectionError("backend restarting")
        return super()._cleanup(key)


def test_cleanup_cut_short_by_a_backend_error_is_retried_at_shutdown(namespace: str) -> None:
    """A request times out while the backend fails; chunks put afterwards (a producer's retried puts
    landing after a restart) are freed when the runtime shuts down, not left to the backend's expiry."""
    conn = _CleanupOutage(namespace)
    producer = MemoryConnector(MemoryConfig(namespace=namespace))  # its keys outlive the consumer's close
    c = make_runtime(1, namespace, connector=conn, async_chunk=True, recv_timeout_s=0.3)
    try:
        c.register_chunk_recv(Req("r"))
        collect_until(c, lambda s: "r" in s.timed_out)  # the timeout's cleanup of r_0_0... hit the outage
        for i in range(3):
            producer.put(0, 1, f"r_0_{i}", {"ids": {"prompt": [i]}})  # landed after the restart
        conn.down = False
        assert producer.keys() == ["r_0_0", "r_0_1", "r_0_2"]
        c.shutdown()
        assert producer.keys() == []
    finally:
        c.shutdown()
        producer.close()
