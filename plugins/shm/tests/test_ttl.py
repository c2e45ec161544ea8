"""Expiry of payloads nobody claims: ``ttl_seconds`` (the producer) and ``gc --ttl`` (anyone), real processes.

The tests wait past a TTL (sleeps) but assert only what is published afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from omni_plugins_shm.naming import Names, parse_name
from omni_plugins_shm.testing import make_payload, namespace_segments, payload_matches, producer_worker, ttl_producer_worker

from omni_plugins import create_connector

KIB = 1 << 10
JOIN = 120


def _kinds(namespace: str, kind: str) -> list[str]:
    return [n for n in namespace_segments(namespace) if (p := parse_name(n)) is not None and p.kind == kind]


def _stop(proc: Any) -> None:
    proc.join(JOIN)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(JOIN)


def test_producer_frees_its_unclaimed_payloads_after_the_ttl(namespace: str, spawn: Any) -> None:
    # one pooled and one dedicated payload (pool_max_segment_bytes below its size); the consumer never comes
    config = {"namespace": namespace, "slot_count": 0, "ttl_seconds": 0.3, "pool_max_segment_bytes": 64 * KIB}
    items = [("orphan-pooled", 1, 4 * KIB), ("orphan-dedicated", 2, 256 * KIB)]
    ready, go, hold = spawn.Queue(), spawn.Event(), spawn.Event()
    proc = spawn.Process(target=ttl_producer_worker, args=(config, items, ready, go, hold))
    proc.start()
    try:
        assert ready.get(timeout=JOIN) == 2
        names = Names(namespace)
        published = {names.published(k) for k, _, _ in items}
        assert published <= set(namespace_segments(namespace))
        go.set()
        assert ready.get(timeout=JOIN) == 2  # the put after the TTL reclaimed both
        left = set(namespace_segments(namespace))
        assert not (published & left)
        with create_connector("shm", {"namespace": namespace, "slot_count": 0}) as consumer:
            assert consumer.get(0, 1, "orphan-pooled") is None  # a late get finds nothing
            assert consumer.get(0, 1, "orphan-dedicated", timeout=0.05) is None
            fresh = consumer.get(0, 1, "fresh")  # younger than the TTL: untouched
            assert fresh is not None and payload_matches(fresh.data, 0, 1024)
        # the dedicated segment is gone; the pooled one went back to its owner's pool (free, not leaked)
        assert len(_kinds(namespace, "f")) == 1 and not _kinds(namespace, "c")
    finally:
        go.set()
        hold.set()
        _stop(proc)
    assert proc.exitcode == 0


def test_payloads_consumed_in_time_are_never_touched(namespace: str) -> None:
    with (
        create_connector("shm", {"namespace": namespace, "slot_count": 0, "ttl_seconds": 0.05}) as producer,
        create_connector("shm", {"namespace": namespace, "slot_count": 0}) as consumer,
    ):
        producer.put(0, 1, "a", make_payload(1, 2 * KIB))
        assert consumer.get(0, 1, "a") is not None
        producer.put(0, 1, "a", make_payload(2, 2 * KIB))  # same key, same pooled segment, a new publication
        time.sleep(0.1)
        producer.put(0, 1, "b", make_payload(3, 2 * KIB))  # expiry runs: "a" (2nd) is expired, the 1st record settled
        assert producer.health()["expired"] == 1
        assert consumer.get(0, 1, "a") is None
        got = consumer.get(0, 1, "b")
        assert got is not None and payload_matches(got.data, 3, 2 * KIB)
        assert producer.health()["pooled_segments"] <= 2


def _gc(namespace: str, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "omni_plugins_shm", "gc", "--namespace", namespace, *extra], capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def test_gc_ttl_frees_a_live_producers_stale_payloads(namespace: str, spawn: Any) -> None:
    config = {"namespace": namespace, "slot_count": 0}  # the producer has no TTL of its own
    items = [("stale", 1, 4 * KIB)]
    ready, hold = spawn.Queue(), spawn.Event()
    proc = spawn.Process(target=producer_worker, args=(config, items, ready, hold))
    proc.start()
    try:
        assert ready.get(timeout=JOIN) == 1
        name = Names(namespace).published("stale")
        report = _gc(namespace, "--ttl", "3600")
        assert name in report["kept"] and report["removed"] == []
        time.sleep(0.3)
        report = _gc(namespace, "--ttl", "0.2", "--dry-run")
        assert report["removed"] == [name] and name in namespace_segments(namespace)
        report = _gc(namespace, "--ttl", "0.2")
        assert report["removed"] == [name] and report["errors"] == []
        assert name not in namespace_segments(namespace)
        assert len(_kinds(namespace, "f")) == 1  # returned to the live producer's pool
        with create_connector("shm", config) as consumer:
            assert consumer.get(0, 1, "stale") is None
    finally:
        hold.set()
        _stop(proc)
    assert proc.exitcode == 0


def test_expiry_records_stay_bounded(namespace: str, monkeypatch: Any, caplog: Any) -> None:
    from omni_plugins_shm import expire

    monkeypatch.setattr(expire, "MAX_RECORDS", 8)
    with (
        create_connector("shm", {"namespace": namespace, "slot_count": 0, "ttl_seconds": 3600}) as producer,
        create_connector("shm", {"namespace": namespace, "slot_count": 0}) as consumer,
    ):
        records = lambda: len(producer._expiry._records)  # noqa: E731
        for i in range(40):  # consumed payloads: their records are compacted away
            producer.put(0, 1, f"c{i}", make_payload(i, KIB))
            assert consumer.get(0, 1, f"c{i}") is not None
        assert records() <= 8
        for i in range(20):  # unclaimed ones beyond the cap: the oldest records are forgotten, with a warning
            producer.put(0, 1, f"u{i}", make_payload(i, KIB))
        assert records() <= 8 and "unclaimed payloads" in caplog.text
        for i in range(20):
            got = consumer.get(0, 1, f"u{i}")  # forgetting a record never drops the payload
            assert got is not None and payload_matches(got.data, i, KIB)
