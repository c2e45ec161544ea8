"""A producer stage SIGKILLed mid-stream: the consumer stage reports its requests timed out, keeps no
state, no thread hangs, and the dead producer's resources are reclaimed.

Real processes: stage 0 runs in a child process (``rel_pipeline.StageProcess``),
stage 1 in the test process; real POSIX shared memory / a real redis-server.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from rel_pipeline import Plan, StageProcess, StreamConsumer, make_runtime

from omni_plugins import create_connector

RECV_TIMEOUT = 3.0
STREAMS = 5


def _runtime_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("omni-send-", "omni-recv-"))]


def _kill_mid_stream(conn: dict[str, Any]) -> tuple[StreamConsumer, int]:
    """Stream slowly from a child producer, SIGKILL it once every stream has 2+ chunks, let the consumer settle."""
    plans = [Plan(f"k{os.getpid()}-{i}-{time.monotonic_ns()}", chunks=200, elems=512) for i in range(STREAMS)]
    ids = [p.id for p in plans]
    rt = make_runtime(1, conn, recv_timeout_s=RECV_TIMEOUT)
    consumer = StreamConsumer(rt)
    producer = StageProcess({"stage_id": 0, "connector": conn})
    try:
        consumer.register(ids, chunks=200)
        producer.send("produce", plans=[p.to_json() for p in plans], step_delay=0.05)
        assert consumer.run_until(lambda c: all(c.outcomes[i].rows >= 2 for i in ids), 60), "the stream never started"
        producer.kill()
        assert producer.proc.returncode == -9
        # every wait is bounded: the consumer must settle on its own, by timeout
        assert consumer.run_until(lambda c: c.settled(ids), RECV_TIMEOUT + 30), {i: vars(consumer.outcomes[i]) for i in ids}
        statuses = {consumer.outcomes[i].status for i in ids}
        assert statuses == {"timed_out"}, statuses
        assert all(2 <= consumer.outcomes[i].rows < 200 for i in ids)
        assert rt.active_request_count() == 0, rt.debug_state()
        assert not rt.collect_signals(), "signals reported twice"
    finally:
        producer.kill()
        rt.shutdown()
    assert _runtime_threads() == [], "runtime threads survived shutdown"
    return consumer, producer.pid


def test_shm_producer_killed(shm_namespace: str) -> None:
    from omni_plugins_shm import gc
    from omni_plugins_shm.testing import namespace_segments

    conn = {"name": "shm", "extra": {"namespace": shm_namespace, "pool_bytes": 16 << 20}}
    _, dead_pid = _kill_mid_stream(conn)
    left = namespace_segments(shm_namespace)
    dead = [n for n in left if f".{dead_pid}-" in n]
    assert dead and set(dead) == set(left), f"only the dead producer's files may remain, found {left}"
    # the next producer instance in the namespace reclaims them (gc on start) and works
    with create_connector("shm", conn["extra"]) as fresh:
        assert [n for n in namespace_segments(shm_namespace) if f".{dead_pid}-" in n] == []
        assert fresh.put(0, 1, "after-crash", {"x": [1, 2]}).ok
        got = fresh.get(0, 1, "after-crash")
        assert got is not None and got.data == {"x": [1, 2]}
    assert gc.collect(shm_namespace).removed == []


def test_redis_producer_killed(redis_server: Any) -> None:
    prefix = f"pk{os.getpid()}:"
    conn = {"name": "redis", "extra": redis_server.connector_config(key_prefix=prefix, ttl_seconds=30)}
    _kill_mid_stream(conn)
    client = redis_server.client()
    try:
        left = list(client.scan_iter(match=prefix + "*"))
        # whatever a SIGKILLed writer can leave behind (a chunk committed after the consumer gave up,
        # a commit marker whose deferred DEL never went out) must expire on its own
        ttls = {k: client.pttl(k) for k in left}
        assert all(0 < ttl <= 600_000 for ttl in ttls.values()), ttls
        client.delete(*left) if left else None
    finally:
        client.close()
