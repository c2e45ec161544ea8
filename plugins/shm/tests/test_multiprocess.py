"""Real processes (spawn) sharing one namespace: pipelines, races, crashes, zero-copy lifetime.

Spawning a process imports torch (seconds on a loaded 2-core box), so each test
packs several checks into few processes.
"""

from __future__ import annotations

import gc as pygc
import os
import signal
from typing import Any

import torch
from omni_plugins_shm import gc
from omni_plugins_shm.testing import (
    make_payload,
    namespace_segments,
    payload_matches,
    pipeline_consumer_worker,
    producer_worker,
    stalled_producer_worker,
    view_holder_worker,
)

from omni_plugins import create_connector

KIB, MIB = 1 << 10, 1 << 20
JOIN = 120


def _kill(proc: Any) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(JOIN)


def test_two_producers_two_consumers_one_namespace(namespace: str, spawn: Any) -> None:
    """Concurrent producer and consumer processes: every payload arrives intact exactly once.

    Producers: a spawned process and this process (putting while the consumers already wait).
    Sizes span the slot table's classes (small and 256 KiB slots here) and the file path (pooled segments,
    and a payload larger than ``pool_max_segment_bytes``: its own segment). First the two consumers race
    for 60 keys put before they started: each key is won by exactly one of them.
    """
    config = {"namespace": namespace, "pool_max_segment_bytes": 2 * MIB, "slot_classes": [(4, 256 * KIB)]}
    sizes = [4 * KIB, 200 * KIB, 1 * MIB, 3 * MIB]  # 3 MiB > pool max: dedicated segment
    items = {
        (p, c): [(f"p{p}-c{c}-{j}", 1000 * p + 100 * c + j, sizes[j % len(sizes)]) for j in range(8)] for p in range(2) for c in range(2)
    }
    race_keys = [f"race-{i}" for i in range(60)]
    with create_connector("shm", config) as parent:
        for i, key in enumerate(race_keys):
            assert parent.put(0, 1, key, {"i": torch.tensor(i)}).ok
        ready, hold, out = spawn.Queue(), spawn.Event(), spawn.Queue()
        producer = spawn.Process(target=producer_worker, args=(config, items[(1, 0)] + items[(1, 1)], ready, hold))
        consumers = [
            spawn.Process(target=pipeline_consumer_worker, args=(config, race_keys, items[(0, c)] + items[(1, c)], out)) for c in range(2)
        ]
        procs = [producer, *consumers]
        for proc in procs:
            proc.start()
        try:
            for c in range(2):  # this process is the second producer
                for key, seed, nbytes in items[(0, c)]:
                    assert parent.put(0, 1, key, make_payload(seed, nbytes)).ok
            reports = [out.get(timeout=240) for _ in consumers]
            assert ready.get(timeout=60) == 16
        finally:
            hold.set()
            for proc in procs:
                proc.join(JOIN)
                _kill(proc)
        assert [p.exitcode for p in procs] == [0, 0, 0]
    won = [k for r in reports for k in r["won"]]
    assert sorted(won) == sorted(race_keys), "each raced key must be taken by exactly one consumer"
    statuses = [status for r in reports for _, status in r["items"]]
    assert statuses == ["ok"] * 32


def test_sigkilled_producer_is_reclaimed_and_views_outlive_it(namespace: str, spawn: Any) -> None:
    """A producer killed with SIGKILL leaves segments; zero-copy views taken before stay valid;
    ``gc.collect`` and a new instance's start-up reclaim everything once the views are gone (the file path)."""
    config = {"namespace": namespace, "slot_count": 0}
    ready = spawn.Queue()
    proc = spawn.Process(target=stalled_producer_worker, args=(config, 6, 256 * KIB, ready))
    proc.start()
    try:
        assert ready.get(timeout=120) == 6
        with create_connector("shm", {**config, "reclaim_on_start": False}) as consumer:
            views = consumer.get_views(0, 1, "stalled-0", timeout=30)  # type: ignore[attr-defined]
            owned = consumer.get(0, 1, "stalled-1", timeout=30)
            assert views is not None and owned is not None
            _kill(proc)
            # a gc while we hold the views keeps our claimed segment (we are alive) and removes the rest
            report = gc.collect(namespace)
            assert any(".k.stalled-5" in n for n in report.removed)
            assert any(".o." in n for n in report.removed), "the dead producer's liveness marker must go"
            assert payload_matches(views.data, 0, 256 * KIB), "views must stay valid after the producer died"
            assert payload_matches(owned.data, 1, 256 * KIB)
            left = namespace_segments(namespace)
            assert any(".c." in n for n in left), f"our claimed segment must survive gc while viewed: {left}"
            del views
            pygc.collect()
        # the viewed segment's owner is gone (gc removed its marker): the segment is unlinked, not handed
        # to a free name of the dead producer that only the next gc or instance would reclaim
        left = namespace_segments(namespace)
        assert not any(".f." in n or ".c." in n for n in left), left
        with create_connector("shm", config):
            pass
    finally:
        _kill(proc)


def test_sigkilled_view_holder_is_reclaimed_by_gc(namespace: str, spawn: Any) -> None:
    """A consumer killed while holding zero-copy views leaves its claimed segment; gc frees it (the file path)."""
    config = {"namespace": namespace, "slot_count": 0}
    with create_connector("shm", config) as producer:
        assert producer.put(0, 1, "held", make_payload(7, 64 * KIB)).ok
        ready = spawn.Queue()
        proc = spawn.Process(target=view_holder_worker, args=(config, "held", ready))
        proc.start()
        try:
            assert ready.get(timeout=120) is True
            claimed = [n for n in namespace_segments(namespace) if ".c." in n]
            assert len(claimed) == 1
            assert gc.collect(namespace).removed == [], "a live consumer's claim must be kept"
        finally:
            _kill(proc)
        report = gc.collect(namespace)
        assert claimed[0] in report.removed
        assert any(".o." in n for n in report.removed)
        # the producer is alive and keeps working after its segment vanished under it
        assert producer.put(0, 1, "again", make_payload(8, 64 * KIB)).ok
        got = producer.get(0, 1, "again", timeout=5)
        assert got is not None and payload_matches(got.data, 8, 64 * KIB)
