"""Aborts reach the stages in either order; nothing may stay in the backend either way.

Producer first (then consumer) is what ``benchmarks/soak.py`` does and it leaves nothing
(``test_soak_bounded``). Consumer first is the hard case: the consumer's abort frees the
chunks already put, but chunks the producer puts *after* that -- the rest of its queue, or
the steps it runs before its own abort arrives -- are never read. An aborted cleanup on the
producer therefore drops its queued sends and frees every key it put.
"""

from __future__ import annotations

import uuid
from typing import Any

from rel_pipeline import Req, StreamConsumer, chunk_output, make_runtime


def _abort_consumer_first(conn: dict[str, Any], leftovers: Any, *, after_close: bool) -> list[str]:
    """Run the race; ``leftovers()`` is read while both stages still run, or after both closed."""
    rid = f"ab-{uuid.uuid4().hex[:6]}"
    producer, consumer_rt = make_runtime(0, conn), make_runtime(1, conn, recv_timeout_s=30)
    consumer = StreamConsumer(consumer_rt)
    try:
        consumer.register([rid], chunks=4)
        producer.send_chunk(Req(rid), chunk_output(rid, 0, 16))
        assert producer.wait_sends(10)
        assert consumer.run_until(lambda c: c.outcomes[rid].rows >= 1, 30)
        consumer.abort([rid])  # the consumer stage learns of the abort first ...
        for index in (1, 2):  # ... the producer still runs two steps before it does
            producer.send_chunk(Req(rid), chunk_output(rid, index, 16))
        producer.cleanup_finished_request(rid, aborted=True)
        assert producer.wait_sends(10)
        assert producer.active_request_count() == 0 and consumer_rt.active_request_count() == 0
        if not after_close:
            return leftovers()
    finally:
        producer.shutdown()
        consumer_rt.shutdown()
    return leftovers()


def test_shm_abort_reaching_the_consumer_first(shm_namespace: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    conn = {"name": "shm", "extra": {"namespace": shm_namespace, "pool_bytes": 8 << 20}}
    # while the producer stage lives (closing its connector frees what it published)
    left = _abort_consumer_first(
        conn, lambda: [n for n in namespace_segments(shm_namespace) if n.split(".")[2] in ("k", "h")], after_close=False
    )
    assert left == []


def test_redis_abort_reaching_the_consumer_first(redis_server: Any) -> None:
    prefix = f"ab-{uuid.uuid4().hex[:6]}:"
    conn = {"name": "redis", "extra": redis_server.connector_config(key_prefix=prefix)}
    try:
        # after both stages closed (deferred deletes of commit markers and claim lists are flushed by then)
        left = _abort_consumer_first(conn, lambda: redis_server.keys(prefix + "*"), after_close=True)
        assert left == []
    finally:
        redis_server.delete_keys(prefix + "*")
