"""The receive thread polls (``connector.poll_any``) right before a burst it expects (``RuntimeTuning.anticipate_s``).

Unit level: a memory connector that counts ``poll_any`` calls. Real shm: two
runtimes over one namespace, the producer sending bursts at a steady interval.
Whether a burst is polled for depends on the machine's timing (a rhythm is
only learnt from steady arrivals, and polling backs off on busy cores), which
the tests do not assert: they check that anticipation is switched on exactly
when the capability and the knob are, that it never polls when it is off, and
that nothing is lost either way. When it polls is ``test_rhythm``'s
deterministic-clock business.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

import pytest
from rt_helpers import FAST, Req, make_runtime

from omni_plugins import StageConfig, create_connector
from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.runtime import StageTransferRuntime

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}
INTERVAL = 0.025


class PollCountingConnector(MemoryConnector):
    """Memory connector that claims ``poll_any`` and counts its calls (the poll itself is its ``wait_any``)."""

    capabilities = dataclasses.replace(MemoryConnector.capabilities, poll_any=True)

    def __init__(self, namespace: str, *, claims_poll: bool = True) -> None:
        super().__init__(MemoryConfig(namespace=namespace))
        if not claims_poll:
            self.capabilities = MemoryConnector.capabilities
        self.polls = 0

    def _poll_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        self.polls += 1
        return super()._poll_any(keys, timeout)


def _steady_bursts(producer: StageTransferRuntime, consumer: StageTransferRuntime, *, streams: int, bursts: int) -> dict[str, list[int]]:
    """Every stream sends one chunk per burst, a burst every INTERVAL; returns what arrived per stream."""
    reqs = [Req(f"s{i}") for i in range(streams)]
    for r in reqs:
        consumer.register_chunk_recv(Req(r.request_id))
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finished: set[str] = set()
    start = time.monotonic()
    for k in range(bursts):
        time.sleep(max(0.0, start + k * INTERVAL - time.monotonic()))
        for r in reqs:
            r.done = k == bursts - 1
            producer.send_chunk(r, {"ids": {"prompt": [k]}})
        for rid, payload in consumer.recv_chunk().items():
            got[rid] = list(payload["ids"]["prompt"])
        finished |= consumer.collect_signals().chunk_finished
    deadline = time.monotonic() + 20
    while len(finished) < streams and time.monotonic() < deadline:
        consumer.wait_ready(0.05)
        for rid, payload in consumer.recv_chunk().items():
            got[rid] = list(payload["ids"]["prompt"])
        finished |= consumer.collect_signals().chunk_finished
    for r in reqs:
        got[r.request_id] = list(consumer.get_local_stage_payload(r.request_id)["ids"]["prompt"])
        consumer.cleanup_finished_request(r.request_id)
    return got


@pytest.mark.parametrize("claims_poll, anticipate_s, anticipates", [(True, 0.001, True), (True, 0.0, False), (False, 0.001, False)])
def test_anticipates_only_with_the_capability_and_the_knob_on(
    runtimes: list, namespace: str, claims_poll: bool, anticipate_s: float, anticipates: bool
) -> None:
    conn = PollCountingConnector(namespace, claims_poll=claims_poll)
    tuning = dataclasses.replace(FAST, anticipate_s=anticipate_s)
    p = make_runtime(0, namespace, connector=conn, tuning=tuning, **STREAM)
    c = make_runtime(1, namespace, connector=conn, tuning=tuning, async_chunk=True)
    runtimes += [p, c]
    assert (c.debug_state()["receiver"]["polls"], conn.polls) == (0, 0)
    got = _steady_bursts(p, c, streams=3, bursts=16)
    assert got == {f"s{i}": list(range(16)) for i in range(3)}  # nothing lost, in order, either way
    state = c.debug_state()
    stats = state["receiver"]
    assert state["arrival_anticipates"] is anticipates
    assert stats["polls"] == conn.polls
    if not anticipates:
        assert conn.polls == 0
    assert stats["poll_hits"] <= stats["polls"]


def test_irregular_arrivals_are_not_polled_for(runtimes: list, namespace: str) -> None:
    conn = PollCountingConnector(namespace)
    p = make_runtime(0, namespace, connector=conn, tuning=FAST, **STREAM)
    c = make_runtime(1, namespace, connector=conn, tuning=FAST, async_chunk=True)
    runtimes += [p, c]
    r = Req("irregular")
    c.register_chunk_recv(Req("irregular"))
    gaps = [0.005, 0.060, 0.010, 0.080, 0.004, 0.045, 0.015, 0.090, 0.006, 0.050]  # never three alike in a row
    for k, gap in enumerate(gaps):
        time.sleep(gap)
        r.done = k == len(gaps) - 1
        p.send_chunk(r, {"ids": {"prompt": [k]}})
    deadline = time.monotonic() + 20
    while "irregular" not in c.collect_signals().chunk_finished and time.monotonic() < deadline:
        c.wait_ready(0.05)
    assert c.get_local_stage_payload("irregular")["ids"]["prompt"] == list(range(len(gaps)))
    assert conn.polls == 0
    c.cleanup_finished_request("irregular")


def test_shm_consumer_polls_for_steady_bursts_and_loses_nothing() -> None:
    pytest.importorskip("omni_plugins_shm")
    ns = f"rt-poll-{uuid.uuid4().hex[:8]}"
    cfg = {"name": "shm", "extra": {"namespace": ns}}
    p = StageTransferRuntime(StageConfig(stage_id=0, **STREAM), cfg, tuning=FAST)
    c = StageTransferRuntime(StageConfig(stage_id=1, async_chunk=True), cfg, tuning=FAST)
    try:
        assert c.connector is not None and c.connector.capabilities.poll_any
        got = _steady_bursts(p, c, streams=4, bursts=16)
        assert got == {f"s{i}": list(range(16)) for i in range(4)}
        state = c.debug_state()
        assert state["arrival_anticipates"] is True
        assert state["receiver"]["poll_hits"] <= state["receiver"]["polls"]
        assert c.active_request_count() == 0
    finally:
        c.shutdown()
        p.shutdown()
    probe = create_connector("shm", {"namespace": ns})
    try:
        assert probe.poll_any([f"s{i}_0_{k}" for i in range(4) for k in range(16)], timeout=0.001) == []  # all consumed
    finally:
        probe.close()


def test_preempted_polls_pause_polling_and_lose_nothing(runtimes: list, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every poll reports a preemption (busy cores): after a few, the receiver stops polling but for probes."""
    from omni_plugins.runtime import receiver as receiver_mod

    switches = iter(range(10**9))  # each read is one more: every poll "was preempted"
    monkeypatch.setattr(receiver_mod, "preemptions", lambda: next(switches))
    conn = PollCountingConnector(namespace)
    p = make_runtime(0, namespace, connector=conn, tuning=FAST, **STREAM)
    c = make_runtime(1, namespace, connector=conn, tuning=FAST, async_chunk=True)
    runtimes += [p, c]
    bursts = 40
    got = _steady_bursts(p, c, streams=3, bursts=bursts)
    assert got == {f"s{i}": list(range(bursts)) for i in range(3)}
    stats = c.debug_state()["receiver"]
    assert stats["polls"] > 0 and stats["polls_preempted"] == stats["polls"]
    # at most: 4 polls until the share of preempted ones passes one half, then one probe per 8 intervals
    assert stats["polls"] <= 4 + bursts // 8 + 1
