"""redis-server SIGKILLed and restarted (AOF, ``appendfsync always``) while a pipeline streams through it.

Every chunk whose ``put`` returned ok must arrive exactly once and in order
(``verify_merged`` checks every row), no put may be given up on, no thread may
hang, the pipeline finishes, and no key is left.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from rel_pipeline import Plan, StageProcess, StreamConsumer, make_runtime, track

CHUNKS = 40


@pytest.fixture
def persistent_redis() -> Iterator[Any]:
    from omni_plugins_redis.testing import RedisServer

    with RedisServer(persistent=True) as server:
        track(server.pid)
        yield server


def test_pipeline_survives_redis_restart(persistent_redis: Any) -> None:
    prefix = f"rr-{uuid.uuid4().hex[:6]}:"
    conn = {"name": "redis", "extra": persistent_redis.connector_config(key_prefix=prefix)}
    # two streams carry 256 KiB chunks (stored as parts), the rest travel inline in the manifest
    plans = [Plan(f"rr-{i}", chunks=CHUNKS, elems=64 * 1024 if i < 2 else 300) for i in range(5)]
    ids = [p.id for p in plans]
    rt = make_runtime(1, conn, recv_timeout_s=60.0)
    consumer = StreamConsumer(rt)
    producer = StageProcess({"stage_id": 0, "connector": conn})
    try:
        consumer.register(ids, chunks=CHUNKS)
        producer.send("produce", plans=[p.to_json() for p in plans], step_delay=0.05, drain_timeout=90.0)
        assert consumer.run_until(lambda c: all(c.outcomes[i].rows >= 3 for i in ids), 60), "the stream never started"
        before = min(consumer.outcomes[i].rows for i in ids)
        persistent_redis.restart(kill=True, down_for=0.3)
        track(persistent_redis.pid)
        produced = producer.wait_event("produced", 120)
        assert produced["drained"] and produced["failed"] == [], produced
        assert produced["active"] == 0
        assert consumer.run_until(lambda c: c.settled(ids), 90), {i: vars(consumer.outcomes[i]) for i in ids}
        outcomes = {i: (consumer.outcomes[i].status, consumer.outcomes[i].error) for i in ids}
        assert outcomes == {i: ("finished", None) for i in ids}
        assert before < CHUNKS, "the restart happened after the streams ended: nothing was tested"
        assert rt.active_request_count() == 0
    finally:
        producer.close()
        rt.shutdown()
    assert [t.name for t in threading.enumerate() if t.name.startswith(("omni-send-", "omni-recv-"))] == []
    left = [k.decode() for k in persistent_redis.keys(prefix + "*")]
    payload_keys = [k for k in left if ":w:" not in k]
    assert payload_keys == [], "manifests, parts or claim lists left behind"
    # Known gap (docs/reliability.md): a commit marker ("...:w:<put id>") whose deferred DEL was lost
    # with the killed server's connection can stay until its own TTL (MARKER_TTL_MS, 10 min).
    client = persistent_redis.client()
    try:
        ttls = {k: client.pttl(k) for k in left}
    finally:
        client.close()
    assert all(0 < ttl <= 600_000 for ttl in ttls.values()), ttls
