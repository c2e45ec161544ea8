"""A consumer out of file descriptors loses nothing: real processes, real /dev/shm, a real RLIMIT_NOFILE.

Each child lowers its own soft ``RLIMIT_NOFILE`` and opens ``/dev/null`` until ``EMFILE``
(:func:`omni_plugins_shm.testing.fill_descriptors`): the shortage is the kernel's, only its timing is
arranged.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

import pytest
from omni_plugins_shm.testing import (
    descriptor_mappings_worker,
    fd_starved_consumer_worker,
    fd_starved_judge_worker,
    fd_starved_runtime_worker,
    last_chunk,
    low_limit_views_worker,
    make_payload,
    namespace_segments,
)

from omni_plugins import TransientConnectorError, create_connector

KIB, MIB = 1 << 10, 1 << 20
JOIN = 60


def _finish(proc: Any) -> None:
    proc.join(JOIN)
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(JOIN)


def _report_of(spawn: Any, worker: Any, *args: Any) -> Any:
    """Run ``worker(*args, pipe)`` in a spawned child: the one report it sends (the child must exit 0)."""
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=worker, args=(*args, child))
    proc.start()
    try:
        assert parent.poll(JOIN)
        report = parent.recv()
    finally:
        _finish(proc)
    assert proc.exitcode == 0
    return report


def test_a_get_at_the_descriptor_limit_keeps_the_payload_and_a_later_get_reads_it(namespace: str, spawn: Any) -> None:
    """The get that cannot open its segment raises the retryable error naming the limit, the payload is
    published again (nothing left under the consumer's claim), and the same get succeeds once descriptors
    are free. A segment whose mapping the consumer cached is read at the limit too: mappings hold no descriptor."""
    config = {"namespace": namespace, "slot_count": 0}  # every payload takes the file path (segments)
    warm, cached, fresh = ("warm", 1, 60 * KIB), ("cached", 2, 60 * KIB), ("fresh", 3, 1 * MIB)
    parent, child = spawn.Pipe()
    with create_connector("shm", config) as producer:
        assert producer.put(0, 1, warm[0], make_payload(warm[1], warm[2])).ok
        proc = spawn.Process(target=fd_starved_consumer_worker, args=(config, [warm, cached, fresh], child))
        proc.start()
        try:
            assert parent.poll(JOIN) and parent.recv() == "ok"
            # ``cached`` reuses the segment ``warm`` came in (returned FREE); ``fresh`` needs a new, larger one
            assert producer.put(0, 1, cached[0], make_payload(cached[1], cached[2])).ok
            assert producer.put(0, 1, fresh[0], make_payload(fresh[1], fresh[2])).ok
            parent.send("go")
            assert parent.poll(JOIN)
            report = parent.recv()
            assert report["cached"] == "ok"
            failed = report["fresh"]
            assert isinstance(failed, dict), failed
            assert failed["transient"] and not failed["corrupt"], failed
            assert "Too many open files" in failed["message"] and "ulimit -n" in failed["message"], failed["message"]
            assert "kept for a retry" in failed["message"], failed["message"]
            left = namespace_segments(namespace)
            assert any(name.endswith(".k.fresh") for name in left), left
            assert not any(".c." in name for name in left), left  # not stranded under the consumer's claim name
            parent.send("free")
            assert parent.poll(JOIN) and parent.recv() == "ok"
        finally:
            _finish(proc)
        assert proc.exitcode == 0
        assert not any(".k." in name for name in namespace_segments(namespace))  # every payload consumed


def test_the_runtime_retries_a_get_at_the_descriptor_limit_and_delivers_the_chunk(namespace: str, spawn: Any) -> None:
    """A consumer stage at its descriptor limit: its receive thread's get fails for a passing reason, the
    request is neither failed nor dropped, and the chunk is delivered intact once descriptors are free."""
    config = {"namespace": namespace, "slot_count": 0}
    seed, nbytes = 7, 512 * KIB
    parent, child = spawn.Pipe()
    with create_connector("shm", config) as producer:
        proc = spawn.Process(target=fd_starved_runtime_worker, args=(config, seed, nbytes, child))
        proc.start()
        try:
            assert parent.poll(JOIN) and parent.recv() == "starved"
            assert producer.put(0, 1, "r_0_0", last_chunk(seed, nbytes)).ok
            assert parent.poll(2 * JOIN)
            report = parent.recv()
        finally:
            _finish(proc)
        assert proc.exitcode == 0
    assert report["transient"] >= 1, report
    assert report["finished"] == ["r"] and report["failed"] == [] and report["timed_out"] == [], report
    assert report["payload_ok"], report


def test_gc_at_the_descriptor_limit_judges_nothing_dead_or_corrupt(namespace: str, spawn: Any) -> None:
    """Out of descriptors, a header cannot be read nor a process's liveness: both raise instead of saying
    "invalid" and "dead", so gc removes nothing of a live producer."""
    config = {"namespace": namespace, "slot_count": 0}
    with create_connector("shm", config) as producer:
        assert producer.put(0, 1, "kept", make_payload(4, 60 * KIB)).ok
        (published,) = [name for name in namespace_segments(namespace) if ".k." in name]
        report = _report_of(spawn, fd_starved_judge_worker, namespace, published, producer.owner_token)
        assert report == {"header": f"errno {errno.EMFILE}", "alive": f"errno {errno.EMFILE}", "gc": f"errno {errno.EMFILE}"}, report
        assert published in namespace_segments(namespace)
        got = producer.get(0, 1, "kept")
        assert got is not None and got.data["seed"] == 4


def test_held_views_of_many_segments_need_no_descriptors(namespace: str, spawn: Any) -> None:
    """A consumer with 32 descriptors to spare holds zero-copy views of 150 payloads, each pinning a segment of
    its own (as a consumer that fell far behind does): the mappings hold no descriptor, so every get succeeds."""
    config = {"namespace": namespace, "slot_count": 0, "zero_copy": True}
    items = [(f"v{i}", 100 + i, 60 * KIB) for i in range(150)]
    parent, child = spawn.Pipe()
    with create_connector("shm", config) as producer:
        for key, seed, nbytes in items:  # all published before the consumer takes any: one segment each
            assert producer.put(0, 1, key, make_payload(seed, nbytes)).ok
        proc = spawn.Process(target=low_limit_views_worker, args=(config, items, 32, child))
        proc.start()
        try:
            assert parent.poll(JOIN)
            statuses = parent.recv()
            assert statuses == ["ok"] * len(items), statuses[-1]
            assert parent.poll(JOIN) and parent.recv() is True
        finally:
            _finish(proc)
        assert proc.exitcode == 0


def test_where_mappings_keep_a_descriptor_the_cache_is_capped_and_gives_way(namespace: str, spawn: Any) -> None:
    """Without the C extension (before Python 3.13) each mapping keeps a descriptor: the map cache then keeps
    at most a quarter of the soft RLIMIT_NOFILE in mappings, and a get at the limit gets its descriptor back
    from the cache's idle mappings instead of failing."""
    config = {"namespace": namespace, "slot_count": 0}
    items = [(f"m{i}", 200 + i, 20 * KIB) for i in range(48)]
    fresh = ("fresh", 300, 200 * KIB)
    with create_connector("shm", config) as producer:
        for key, seed, nbytes in [*items, fresh]:  # all published first: one segment each
            assert producer.put(0, 1, key, make_payload(seed, nbytes)).ok
        report = _report_of(spawn, descriptor_mappings_worker, config, items, fresh)
    assert report["statuses"] == ["ok"] * len(items)
    assert 0 < report["cached"] <= report["cap"] < len(items), report
    assert report["fresh"] == "ok", report


def test_a_producer_out_of_descriptors_gets_the_retryable_error_from_put_and_put_many(namespace: str, monkeypatch: Any) -> None:
    """Getting a segment that fails for want of descriptors is a shortage on both file paths of a put."""
    config = {"namespace": namespace, "slot_count": 0}
    with create_connector("shm", config) as producer:

        def starved(nbytes: int) -> Any:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(producer._pool, "acquire", starved)
        with pytest.raises(TransientConnectorError, match="RLIMIT_NOFILE"):
            producer.put(0, 1, "one", make_payload(1, 60 * KIB))
        with pytest.raises(TransientConnectorError, match="RLIMIT_NOFILE"):
            producer.put_many([(0, 1, "a"), (0, 2, "b")], make_payload(2, 60 * KIB))
        monkeypatch.undo()
        assert [name for name in namespace_segments(namespace) if ".k." in name] == []  # nothing was published
