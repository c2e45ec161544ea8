"""Security properties one level above the connectors: a whole pipeline (runtime, two processes) over
a TLS-only Redis as a least-privilege ACL user, a stage with a wrong password failing clearly, and
shared-memory files staying 0600 under a permissive umask.

Connector-level checks live with their owners and are not repeated here:
``tests/redis/test_security.py`` (ACL user, wrong password, NOPERM outside the prefix, TLS-only,
unix socket) and ``tests/shm/test_connector.py::test_segments_and_markers_are_mode_0600``.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))

from rel_pipeline import Plan, Req, StageProcess, StreamConsumer, chunk_output, make_runtime, produce

ADMIN_PW = "admin-Secret-9"
APP_PW = "app-Secret-8"
PREFIX = "sec:"


@pytest.fixture(scope="module")
def tls_acl_server() -> Iterator[Any]:
    from omni_plugins_redis.connector import acl_rule
    from omni_plugins_redis.testing import RedisServer

    with RedisServer(tls=True, password=ADMIN_PW, acl_users=[f"app on >{APP_PW} {acl_rule(PREFIX)}"]) as server:
        yield server
        assert server.keys("*") == []


def _app_config(server: Any, **over: Any) -> dict[str, Any]:
    config = server.connector_config(key_prefix=PREFIX, username="app", password=APP_PW)
    config.update(over)
    return {"name": "redis", "extra": config}


def test_pipeline_over_tls_only_redis_as_prefix_restricted_user(tls_acl_server: Any) -> None:
    conn = _app_config(tls_acl_server)
    assert conn["extra"]["url"].startswith("rediss://")
    plans = [Plan(f"tls-{i}", chunks=4, elems=64 * 1024 if i == 0 else 300, abort_after=2 if i == 3 else None) for i in range(4)]
    live = [p.id for p in plans if not p.aborted]
    rt = make_runtime(1, conn, recv_timeout_s=60)
    consumer = StreamConsumer(rt)
    producer = StageProcess({"stage_id": 0, "connector": conn})
    try:
        consumer.register([p.id for p in plans])
        produced = producer.call("produce", "produced", timeout=120, plans=[p.to_json() for p in plans])
        assert produced["failed"] == []
        assert consumer.run_until(lambda c: c.settled(live), 60)
        assert {i: (consumer.outcomes[i].status, consumer.outcomes[i].error) for i in live} == {i: ("finished", None) for i in live}
        consumer.abort([p.id for p in plans if p.aborted])
        assert rt.active_request_count() == 0
    finally:
        producer.close()
        rt.shutdown()
    assert tls_acl_server.keys("*") == []


def test_stage_with_wrong_password_reports_failure_without_leaking_it(tls_acl_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "wrong-Secret-7"
    rt = make_runtime(0, _app_config(tls_acl_server, password=wrong, retry_attempts=0), max_send_retries=1)
    try:
        with caplog.at_level(logging.WARNING):
            assert rt.send_chunk(Req("pw-1", done=True), chunk_output("pw-1", 0, 8))
            assert rt.wait_sends(30)
            signals = rt.collect_signals()
        assert signals.failed == {"pw-1"}
        text = "\n".join(r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "") for r in caplog.records)
        assert "rejected user 'app'" in text and "127.0.0.1" in text, text[-2000:]
        assert wrong not in text and wrong not in repr(rt.debug_state())
        rt.cleanup_finished_request("pw-1")
        assert rt.active_request_count() == 0
    finally:
        rt.shutdown()
    assert tls_acl_server.keys("*") == []


def test_shm_files_stay_0600_under_umask_0(shm_namespace: str) -> None:
    """Every file a running pipeline creates (pool, published, claimed, markers) is 0600, and the publish
    directory 0700, even with umask 0."""
    from omni_plugins_shm.naming import publish_dir_name
    from omni_plugins_shm.testing import namespace_segments, segment_path

    # no larger slot classes: the 1.2 MiB chunks take the file path (pooled, published and claimed files)
    conn = {"name": "shm", "extra": {"namespace": shm_namespace, "pool_bytes": 8 << 20, "slot_classes": []}}
    modes: dict[str, int] = {}
    stop = threading.Event()

    pubdir = os.path.join("/dev/shm", publish_dir_name(shm_namespace))

    def sample() -> None:
        while not stop.is_set():
            try:
                modes["(publish directory)"] = stat.S_IMODE(os.stat(pubdir).st_mode)
            except FileNotFoundError:
                pass
            for name in namespace_segments(shm_namespace):
                try:
                    modes[name] = stat.S_IMODE(os.stat(segment_path(name)).st_mode)
                except FileNotFoundError:
                    continue

    old = os.umask(0)
    watcher = threading.Thread(target=sample, daemon=True)
    try:
        producer, consumer_rt = make_runtime(0, conn), make_runtime(1, conn, recv_timeout_s=30)
        consumer = StreamConsumer(consumer_rt)
        watcher.start()
        try:
            ids = [f"um-{uuid.uuid4().hex[:4]}-{i}" for i in range(4)]
            consumer.register(ids, chunks=3)

            produce(producer, [Plan(i, chunks=3, elems=2048 if n else 300_000) for n, i in enumerate(ids)], step_delay=0.02)
            assert consumer.run_until(lambda c: c.settled(ids), 60)
            assert {consumer.outcomes[i].status for i in ids} == {"finished"}
        finally:
            stop.set()
            watcher.join(10)
            producer.shutdown()
            consumer_rt.shutdown()
    finally:
        os.umask(old)
    assert modes.pop("(publish directory)") == 0o700
    kinds = {n.split(".")[2] for n in modes}
    assert {"o", "f"} <= kinds, kinds
    assert {n: oct(m) for n, m in modes.items() if m != 0o600} == {}
