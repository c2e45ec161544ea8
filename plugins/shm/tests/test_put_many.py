"""``put_many`` over shared memory: one segment written once under every key (file path), a slot per key (slot table).

The file path publishes one segment under a hard link per key; the holder of the last name gives it
back. What must hold: every key reads the payload as it was at put_many, the segment goes back to
its producer once and only after the last key is done with it (also with zero-copy views held,
concurrent readers, a reader that died, cleanup and TTL), and nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
import torch
from omni_plugins_shm import gc, wakeslots
from omni_plugins_shm.naming import Names
from omni_plugins_shm.segments.header import STATE_FREE, STATE_OFFSET
from omni_plugins_shm.testing import make_payload, payload_matches, view_holder_worker

from omni_plugins import create_connector
from omni_plugins import wire as wire_mod

KIB, MIB = 1 << 10, 1 << 20
JOIN = 120


def _files(namespace: str, **more: Any) -> dict[str, Any]:
    return {"namespace": namespace, "slot_count": 0, **more}


def _targets(keys: list[str]) -> list[tuple[int, int, str]]:
    return [(0, i + 1, k) for i, k in enumerate(keys)]


def _published(namespace: str) -> dict[str, os.stat_result]:
    names = Names(namespace)
    pub = f"/dev/shm/{names.publish_dir}"
    return {n: os.stat(f"{pub}/{n}") for n in os.listdir(pub) if n.startswith((f"{names.prefix}k.", f"{names.prefix}h."))}


def _pool(conn: Any) -> list[Any]:
    """The producer's pooled segments."""
    return [seg for group in conn._pool._classes.values() for seg in group.segments]


def _free(seg: Any) -> bool:
    return bool(seg.view[STATE_OFFSET] == STATE_FREE)


@pytest.fixture
def encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen = [0]
    real = wire_mod.encode

    def encode(data: Any) -> Any:
        seen[0] += 1
        return real(data)

    monkeypatch.setattr(wire_mod, "encode", encode)
    return seen


def test_one_segment_under_every_key_returned_after_the_last(namespace: str, encodes: list[int]) -> None:
    keys = [f"fan-{i}" for i in range(3)]
    payload = make_payload(1, 1 * MIB)
    with create_connector("shm", _files(namespace)) as producer, create_connector("shm", _files(namespace)) as consumer:
        results = producer.put_many(_targets(keys), payload)
        assert all(r.ok for r in results) and encodes[0] == 1
        payload["x"].fill_(0.0)  # every key holds what was there at put_many
        stats = _published(namespace)
        assert len(stats) == 3 and len({s.st_ino for s in stats.values()}) == 1 and {s.st_nlink for s in stats.values()} == {3}
        (seg,) = _pool(producer)
        for i, key in enumerate(keys[:2]):
            got = consumer.get(0, i + 1, key, timeout=5)
            assert got is not None and payload_matches(got.data, 1, 1 * MIB)
            assert not _free(seg), "given back while a key of it was still unread"
        got = consumer.get(0, 3, keys[2], timeout=5)
        assert got is not None and payload_matches(got.data, 1, 1 * MIB)
        assert _free(seg)
        assert producer.put(0, 1, "next", make_payload(2, 1 * MIB)).ok and _pool(producer) == [seg]  # reused
        assert consumer.get(0, 1, "next", timeout=5) is not None


def test_zero_copy_views_keep_the_segment_until_they_die(namespace: str) -> None:
    keys = ["view-a", "view-b"]
    with (
        create_connector("shm", _files(namespace)) as producer,
        create_connector("shm", _files(namespace, zero_copy=True)) as viewer,
        create_connector("shm", _files(namespace)) as reader,
    ):
        assert all(r.ok for r in producer.put_many(_targets(keys), make_payload(3, 512 * KIB)))
        views = viewer.get(0, 1, "view-a", timeout=5)
        got = reader.get(0, 2, "view-b", timeout=5)
        assert views is not None and got is not None and payload_matches(got.data, 3, 512 * KIB)
        (seg,) = _pool(producer)
        assert not _free(seg)
        assert producer.put(0, 1, "other", make_payload(4, 512 * KIB)).ok
        assert len(_pool(producer)) == 2  # the views' segment was not reused
        assert payload_matches(views.data, 3, 512 * KIB)
        del views
        assert _free(seg)
        assert reader.get(0, 1, "other", timeout=5) is not None


def test_cleanup_of_one_key_leaves_the_others(namespace: str) -> None:
    keys = ["c-0", "c-1", "c-2"]
    with create_connector("shm", _files(namespace)) as producer, create_connector("shm", _files(namespace)) as consumer:
        assert all(r.ok for r in producer.put_many(_targets(keys), make_payload(5, 256 * KIB)))
        assert producer.cleanup("c-1") is True and consumer.get(0, 2, "c-1") is None
        assert producer.put(0, 1, "c-2", {"newer": torch.ones(3)}).ok  # a put replaces one key of the fan-out
        got = consumer.get(0, 1, "c-0", timeout=5)
        assert got is not None and payload_matches(got.data, 5, 256 * KIB)
        (seg, *_) = _pool(producer)
        assert _free(seg)  # its last name went with the replacement
        newer = consumer.get(0, 3, "c-2", timeout=5)
        assert newer is not None and torch.equal(newer.data["newer"], torch.ones(3))


def test_dedicated_segment_under_every_key(namespace: str) -> None:
    """A payload larger than ``pool_max_segment_bytes``: one dedicated segment, each name unlinked by its reader."""
    keys = ["big-0", "big-1"]
    config = _files(namespace, pool_max_segment_bytes=1 * MIB)
    with create_connector("shm", config) as producer, create_connector("shm", config) as consumer:
        assert all(r.ok for r in producer.put_many(_targets(keys), make_payload(6, 2 * MIB)))
        assert _pool(producer) == [] and len({s.st_ino for s in _published(namespace).values()}) == 1
        for i, key in enumerate(keys):
            got = consumer.get(0, i + 1, key, timeout=5)
            assert got is not None and payload_matches(got.data, 6, 2 * MIB)
        assert _published(namespace) == {}


def test_unread_keys_go_with_the_producer(namespace: str) -> None:
    with create_connector("shm", _files(namespace)) as producer:
        assert all(r.ok for r in producer.put_many(_targets(["gone-0", "gone-1"]), make_payload(7, 64 * KIB)))
    # the namespace fixture checks nothing is left


def test_ttl_frees_an_unread_key_and_gives_the_segment_back(namespace: str) -> None:
    config = _files(namespace, ttl_seconds=0.2)
    with create_connector("shm", config) as producer, create_connector("shm", config) as consumer:
        assert all(r.ok for r in producer.put_many(_targets(["t-0", "t-1"]), make_payload(8, 64 * KIB)))
        got = consumer.get(0, 1, "t-0", timeout=5)
        assert got is not None and payload_matches(got.data, 8, 64 * KIB)
        (seg,) = _pool(producer)
        assert not _free(seg)
        threading.Event().wait(0.5)  # let t-1 outlive the TTL (the assertion is on what the next put reclaims)
        assert producer.put(0, 1, "fresh", {"v": torch.ones(2)}).ok
        assert producer.health()["expired"] == 1 and _free(seg)
        assert consumer.get(0, 2, "t-1") is None
        assert consumer.get(0, 1, "fresh", timeout=5) is not None


def test_concurrent_readers_give_every_segment_back_once(namespace: str) -> None:
    """Four threads read the four keys of each of 60 fan-outs at once: each segment comes back exactly when its
    last name is gone, so the pool stays a few segments and every one ends FREE (a lost return would grow it)."""
    keys = [f"r{t}" for t in range(4)]
    rounds = 60
    errors: list[str] = []
    barrier = threading.Barrier(5)

    def read(conn: Any, t: int) -> None:
        for n in range(rounds):
            barrier.wait(30)
            got = conn.get(0, t + 1, f"{keys[t]}-{n}", timeout=30)
            if got is None or not payload_matches(got.data, n, 128 * KIB):
                errors.append(f"{keys[t]}-{n}")
            del got

    with create_connector("shm", _files(namespace)) as producer, create_connector("shm", _files(namespace)) as consumer:
        threads = [threading.Thread(target=read, args=(consumer, t)) for t in range(4)]
        for th in threads:
            th.start()
        for n in range(rounds):
            assert all(r.ok for r in producer.put_many(_targets([f"{k}-{n}" for k in keys]), make_payload(n, 128 * KIB)))
            barrier.wait(30)
        for th in threads:
            th.join(JOIN)
        assert errors == []
        pool = _pool(producer)
        assert len(pool) <= 4 and all(_free(seg) for seg in pool)


def test_slot_table_payloads_take_a_slot_per_key(namespace: str) -> None:
    if not wakeslots.available():
        pytest.skip("the slot table needs the C extension")
    keys = ["s-0", "s-1", "s-2"]
    with create_connector("shm", {"namespace": namespace}) as producer, create_connector("shm", {"namespace": namespace}) as consumer:
        assert all(r.ok for r in producer.put_many(_targets(keys), {"v": torch.arange(100)}))
        assert len(producer._slots.scan()) == 3 and _published(namespace) == {}  # type: ignore[attr-defined]
        for i, key in enumerate(keys):
            got = consumer.get(0, i + 1, key, timeout=5)
            assert got is not None and torch.equal(got.data["v"], torch.arange(100))


def test_a_reader_that_died_holding_one_key(namespace: str, spawn: Any) -> None:
    """A reader killed with zero-copy views of one key: gc removes its claim, and the other key's reader then gives
    the segment back (it holds the last name)."""
    config = _files(namespace)
    with create_connector("shm", config) as producer, create_connector("shm", config) as consumer:
        assert all(r.ok for r in producer.put_many(_targets(["dead-0", "live-1"]), make_payload(9, 64 * KIB)))
        ready = spawn.Queue()
        proc = spawn.Process(target=view_holder_worker, args=(config, "dead-0", ready))
        proc.start()
        try:
            assert ready.get(timeout=JOIN) is True
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(JOIN)
        assert any(".c." in name for name in gc.collect(namespace).removed)
        (seg,) = _pool(producer)
        assert not _free(seg)
        got = consumer.get(0, 2, "live-1", timeout=5)
        assert got is not None and payload_matches(got.data, 9, 64 * KIB)
        assert _free(seg)


def test_keys_the_table_has_no_room_for_take_the_file_path(namespace: str) -> None:
    """Two slots for four keys: the first two keys take a slot each, the others a segment each; every key delivers."""
    if not wakeslots.available():
        pytest.skip("the slot table needs the C extension")
    config = {"namespace": namespace, "slot_count": 2, "slot_bytes": 16 * KIB, "slot_classes": []}
    keys = [f"full-{i}" for i in range(4)]
    with create_connector("shm", config) as producer, create_connector("shm", config) as consumer:
        results = producer.put_many(_targets(keys), {"v": torch.arange(64)})
        assert all(r.ok for r in results)
        assert len(producer._slots.scan()) == 2 and len(_published(namespace)) == 2  # type: ignore[attr-defined]
        for i, key in enumerate(keys):
            got = consumer.get(0, i + 1, key, timeout=5)
            assert got is not None and torch.equal(got.data["v"], torch.arange(64))


def test_a_file_mapped_twice_keeps_the_mapping_a_reader_may_be_using(tmp_path: Any) -> None:
    """Two threads that miss the map cache for one segment (two keys of it) both map it: the second gets the first's
    mapping, which stays valid, instead of replacing it under the first reader."""
    from omni_plugins_shm.proc import Owner
    from omni_plugins_shm.segments.header import Header
    from omni_plugins_shm.segments.mapcache import MapCache

    path = tmp_path / "segment"
    path.write_bytes(b"\0" * 65536)
    header = Header(Owner(os.getpid(), 2, 3), 0, 65536, 100, b"d" * 16, True)
    cache = MapCache(1 << 20)
    fds = [os.open(path, os.O_RDWR) for _ in range(2)]
    try:
        first = cache.map((1, 1), fds[0], header)
        second = cache.map((1, 1), fds[1], header)
        assert second is first
        first.view[200] = 7  # still mapped
        assert cache.lookup((1, 1)) is first and cache.stats()["cached_mappings"] == 1
    finally:
        for fd in fds:
            os.close(fd)
        cache.clear()
