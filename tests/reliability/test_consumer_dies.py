"""A consumer stage SIGKILLed while its producer keeps streaming: the undelivered payloads must not
stay forever -- Redis expires them by TTL, shared memory frees them when their producer closes (or gc
once it is dead). The producer stage itself keeps no per-request state.

Stage 1 runs in a child process (``rel_pipeline.StageProcess``), stage 0 in the test process.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from rel_pipeline import Plan, Req, StageProcess, chunk_output, make_runtime

STREAMS = 4
CHUNKS = 6


def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stream_into_dead_consumer(
    conn: dict[str, Any], undelivered: Callable[[], int], settled: Callable[[], bool] | None = None
) -> tuple[Any, int]:
    """Chunks 0-1 reach the consumer, which is then killed; chunks 2-5 are put for nobody.

    ``settled``: the backend shows the consumer done with chunks 0-1 (default: nothing undelivered).
    """
    tag = uuid.uuid4().hex[:6]
    first = [Plan(f"cd-{tag}-{i}", chunks=CHUNKS, elems=400, abort_after=2) for i in range(STREAMS)]
    rt = make_runtime(0, conn)
    consumer = StageProcess({"stage_id": 1, "connector": conn, "recv_timeout_s": 60.0})
    try:
        consumer.call("register", "registered", ids=[p.id for p in first], chunks=CHUNKS)
        for index in range(2):
            for p in first:
                rt.send_chunk(_req(p.id), _out(p, index))
        assert rt.wait_sends(30)
        assert _wait(settled or (lambda: undelivered() == 0), 60), "the consumer never took the first chunks"
        consumer.kill()
        assert consumer.proc.returncode == -9
        # the rest of each stream goes out to nobody; the producer finishes its requests normally
        for index in range(2, CHUNKS):
            for p in first:
                req = _req(p.id, done=index == CHUNKS - 1)
                rt.send_chunk(req, _out(p, index))
        assert rt.wait_sends(30)
        for p in first:
            rt.cleanup_finished_request(p.id)
        assert rt.active_request_count() == 0, rt.debug_state()
        assert undelivered() == STREAMS * (CHUNKS - 2)
        return rt, consumer.pid
    except BaseException:
        consumer.kill()
        rt.shutdown()
        raise


def _req(rid: str, done: bool = False) -> Req:
    return Req(rid, done=done)


def _out(plan: Plan, index: int) -> dict[str, Any]:
    return chunk_output(plan.id, index, plan.elems)


def test_redis_undelivered_payloads_expire(redis_server: Any) -> None:
    prefix = f"cd-{uuid.uuid4().hex[:6]}:"
    conn = {"name": "redis", "extra": redis_server.connector_config(key_prefix=prefix, ttl_seconds=2)}

    def undelivered() -> int:
        return sum(1 for k in redis_server.keys(prefix + "*") if k.endswith(b":m"))

    def settled() -> bool:
        # taken (no manifest) and done with (no claim list: a consumed payload's claim list is deleted with the
        # consumer's next command; SIGKILLed before that, it would stay for its own 10-minute TTL, not the payloads')
        return not any(k.endswith(b":m") or b":c:" in k for k in redis_server.keys(prefix + "*"))

    rt, _ = _stream_into_dead_consumer(conn, undelivered, settled)
    try:
        client = redis_server.client()
        try:
            ttls = {k: client.pttl(k) for k in client.scan_iter(match=prefix + "*")}
        finally:
            client.close()
        assert ttls and all(0 < ttl <= 2000 for k, ttl in ttls.items() if k.endswith(b":m")), ttls
        assert all(ttl > 0 for ttl in ttls.values()), f"keys without expiry: {ttls}"

        # the producer is still running: expiry alone must clear the payloads (a commit marker of the
        # last put waits for the connection's next write or close to be deleted; it has a TTL too)
        def payloads() -> list[bytes]:
            return [k for k in redis_server.keys(prefix + "*") if b":w:" not in k]

        assert _wait(lambda: payloads() == [], 30), payloads()
    finally:
        rt.shutdown()
    assert redis_server.keys(prefix + "*") == []


@pytest.mark.parametrize("slot_count", [0, 256], ids=["files", "slots"])
def test_shm_undelivered_payloads_freed_with_their_producer(shm_namespace: str, slot_count: int) -> None:
    from omni_plugins_shm import gc
    from omni_plugins_shm.testing import namespace_segments, slot_payloads

    conn = {"name": "shm", "extra": {"namespace": shm_namespace, "pool_bytes": 16 << 20, "slot_count": slot_count}}

    def undelivered() -> int:  # payloads in files (k./h.) and in the slot table
        files = sum(1 for n in namespace_segments(shm_namespace) if n.split(".")[2] in ("k", "h"))
        return files + slot_payloads(shm_namespace)

    rt, dead_pid = _stream_into_dead_consumer(conn, undelivered)
    try:
        # gc takes what the dead consumer owned (its marker, any claim it held) and nothing else:
        # shared memory has no TTL, unread payloads belong to their (live) producer
        report = gc.collect(shm_namespace)
        assert all(f".{dead_pid}-" in name for name in report.removed), report.removed
        assert not [n for n in namespace_segments(shm_namespace) if f".{dead_pid}-" in n]
        assert undelivered() == STREAMS * (CHUNKS - 2)
    finally:
        rt.shutdown()  # closing the producer's connector frees what it published and nobody read
    assert namespace_segments(shm_namespace) == []
