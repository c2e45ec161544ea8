"""``mooncake_master`` killed and restarted under a running two-process pipeline (``mooncake-store``).

While the master is down the producer's sends fail with errors that name the
master, are retried and then reported failed in the producer's signals; the
consumer's waits end by timeout (reported ``timed_out``); nothing hangs. After
the restart the same runtimes -- no new processes, no new connectors -- carry
streams end to end again, and no store object is left.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from rel_pipeline import Plan, StageProcess, StreamConsumer, make_runtime, track

pytest.importorskip("mooncake.store")

RECV_TIMEOUT = 4.0


@pytest.fixture
def master() -> Iterator[Any]:
    from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment

    loopback_environment()
    m = MooncakeMaster()
    m.start()
    track(m.pid)
    try:
        yield m
    finally:
        m.stop()


def _store(master: Any, segment: str) -> dict[str, Any]:
    return {
        "name": "mooncake-store",
        "extra": {"master_address": master.address, "global_segment_size": segment, "local_buffer_size": "16MiB", "connect_timeout": 2.0},
    }


def _objects(master: Any) -> int:
    """Objects the master holds (removes them; call at the end)."""
    from mooncake.store import MooncakeDistributedStore

    probe = MooncakeDistributedStore()
    assert probe.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        return int(probe.remove_all(True))
    finally:
        probe.close()


def _batch(tag: str, n: int, chunks: int) -> list[Plan]:
    return [Plan(f"mc-{tag}-{i}-{uuid.uuid4().hex[:4]}", chunks=chunks, elems=256) for i in range(n)]


def _run(producer: StageProcess, consumer: StreamConsumer, plans: list[Plan], timeout: float) -> tuple[dict[str, Any], dict[str, str]]:
    ids = [p.id for p in plans]
    consumer.register(ids, chunks={p.id: p.chunks for p in plans})
    produced = producer.call("produce", "produced", timeout=timeout, plans=[p.to_json() for p in plans], drain_timeout=timeout)
    consumer.run_until(lambda c: c.settled(ids), timeout)
    statuses = {i: consumer.outcomes[i].status for i in ids}
    errors = [consumer.outcomes[i].error for i in ids if consumer.outcomes[i].error]
    assert errors == [], errors
    consumer.forget(ids)
    return produced, statuses


def test_pipeline_errors_clearly_then_recovers_after_master_restart(master: Any) -> None:
    rt = make_runtime(1, _store(master, "0"), recv_timeout_s=RECV_TIMEOUT)
    consumer = StreamConsumer(rt)
    producer = StageProcess(
        {"stage_id": 0, "connector": _store(master, "64MiB"), "tuning": {"retry_backoff_s": 0.05, "max_send_retries": 1}}
    )
    try:
        produced, statuses = _run(producer, consumer, _batch("up", 3, 4), 60)
        assert produced["failed"] == [] and set(statuses.values()) == {"finished"}, (produced, statuses)

        master.kill()
        down = _batch("down", 1, 1)  # each failing put takes seconds (the client's RPC timeout)
        produced, statuses = _run(producer, consumer, down, RECV_TIMEOUT + 60)
        assert sorted(produced["failed"]) == sorted(p.id for p in down), produced
        assert set(statuses.values()) == {"timed_out"}, statuses
        assert master.address in producer.stderr_tail(20000), "the producer's errors do not name the master"
        assert produced["active"] == 0 and rt.active_request_count() == 0

        master.restart()
        track(master.pid)
        deadline, attempts = time.monotonic() + 90, 0
        while True:  # the store clients re-register with the new master on their own
            attempts += 1
            produced, statuses = _run(producer, consumer, _batch(f"re{attempts}", 2, 3), RECV_TIMEOUT + 30)
            if produced["failed"] == [] and set(statuses.values()) == {"finished"}:
                break
            assert time.monotonic() < deadline, f"no recovery after {attempts} attempts: {produced} {statuses}"
        assert rt.active_request_count() == 0
        assert int(producer.call("state", "state")["active"]) == 0
    finally:
        producer.close()
        rt.shutdown()
    assert _objects(master) == 0
