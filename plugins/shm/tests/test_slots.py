"""The slot table (``slot_count > 0``): small payloads by compare-and-swap, the file path for the rest.

Real processes (spawn) share one namespace; crashes are real SIGKILLs of processes holding a slot.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from omni_plugins_shm import gc, slots, wakeslots
from omni_plugins_shm.expire import collect_expired
from omni_plugins_shm.naming import Names
from omni_plugins_shm.testing import (
    consumer_worker,
    make_payload,
    namespace_segments,
    payload_matches,
    pipeline_consumer_worker,
    producer_worker,
    slot_crash_worker,
)

from omni_plugins import create_connector, wire
from omni_plugins.errors import ConfigError, ConnectorError, CorruptPayloadError, WireFormatError
from omni_plugins.testing import ConnectorContract

pytestmark = pytest.mark.skipif(not wakeslots.available(), reason="the slot table needs the C extension")

KIB = 1 << 10
JOIN = 120


def _config(namespace: str, **more: Any) -> dict[str, Any]:
    return {"namespace": namespace, "slot_count": 64, "slot_bytes": 16 * KIB, "slot_classes": [], **more}


def _published_files(namespace: str) -> list[str]:
    names = Names(namespace)
    return [
        n for n in os.listdir(f"/dev/shm/{names.publish_dir}") if n.startswith(f"{names.prefix}k.") or n.startswith(f"{names.prefix}h.")
    ]


def _busy(conn: Any) -> list[slots.SlotInfo]:
    return conn._slots.scan()  # type: ignore[no-any-return]


class TestShmContractSlots(ConnectorContract):
    """The core contract with the slot table on (its payloads are small: they go through the slots)."""

    cross_process = True
    bad_config = {"slot_count": -1}

    @pytest.fixture
    def connector_spec(self, namespace: str) -> tuple[str, dict[str, Any]]:
        return "shm", _config(namespace)


def test_small_payloads_use_slots_big_ones_files(namespace: str) -> None:
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        assert a.put(0, 1, "small", make_payload(1, 4 * KIB)).ok
        assert _published_files(namespace) == [] and len(_busy(a)) == 1
        assert a.put(0, 1, "big", make_payload(2, 64 * KIB)).ok  # > slot_bytes: a file
        assert len(_published_files(namespace)) == 1
        small = b.get(0, 1, "small", timeout=5)
        big = b.get(0, 1, "big", timeout=5)
        assert small is not None and payload_matches(small.data, 1, 4 * KIB)
        assert big is not None and payload_matches(big.data, 2, 64 * KIB)
        assert b.get(0, 1, "small") is None and b.get(0, 1, "big") is None  # consumed once
        assert _busy(a) == [] and _published_files(namespace) == []
        # owned results: writable, no tie to the slot (get_views also copies slot payloads)
        a.put(0, 1, "v", {"t": torch.arange(10)})
        views = b.get_views(0, 1, "v", timeout=5)
        assert views is not None and _busy(a) == []
        views.data["t"] += 1
        assert views.data["t"].tolist() == list(range(1, 11))


def test_file_path_hint_counts_unconsumed_file_payloads(namespace: str) -> None:
    """The table's hint: raised by a file-path put, lowered by the get that consumes it; table payloads leave it alone."""
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        hint = a._slots.files_add
        a.put(0, 1, "s", make_payload(1, KIB))
        assert hint(0) == 0
        a.put(0, 1, "f1", make_payload(2, 32 * KIB))
        a.put(0, 1, "f2", make_payload(3, 32 * KIB))
        assert hint(0) == 2
        assert b.wait_any(["f2", "s", "x"], 0) == ["s", "f2"]  # the hint sends wait_any to the directory
        res = b.get(0, 1, "f1", timeout=5)
        assert res is not None and payload_matches(res.data, 2, 32 * KIB)
        assert hint(0) == 1
        res = b.get(0, 1, "f2")
        assert res is not None and hint(0) == 0
        assert hint(-5) == 0  # never below zero
        assert b.get(0, 1, "s", timeout=5) is not None
        a.put(0, 1, "r", make_payload(4, 32 * KIB))
        a.put(0, 1, "r", make_payload(5, 32 * KIB))  # replaces the unconsumed one
        assert hint(0) == 1
        assert b.cleanup("r") and hint(0) == 0
        with create_connector("shm", _config(namespace)) as c:
            c.put(0, 1, "c", make_payload(6, 32 * KIB))
            assert hint(0) == 1
        assert hint(0) == 0  # c's close freed its unconsumed file payload and lowered the hint


def test_take_or_wait_looks_sleeps_and_looks_again(namespace: str) -> None:
    """The blocking get's one C call: a hit at once; a miss sleeps on the seq its look read (a put from another
    thread wakes it and the second look takes the payload); a sleep that runs out marks the miss TIMED_OUT; with
    the file-path hint up it returns the miss at once (the caller looks at the file path)."""
    with create_connector("shm", _config(namespace)) as a:
        table = a._slots  # type: ignore[attr-defined]
        a.put(0, 1, "k", make_payload(1, KIB))
        got = table.take_or_wait("k", 5.0)
        assert isinstance(got, bytearray) and payload_matches(wire.decode(got), 1, KIB)
        timer = threading.Timer(0.2, lambda: a.put(0, 1, "late", make_payload(2, KIB)))
        timer.start()
        got = table.take_or_wait("late", 30.0)  # woken by the put, not by the 30 s bound
        timer.join()
        assert isinstance(got, bytearray) and payload_matches(wire.decode(got), 2, KIB)
        miss = table.take_or_wait("never", 0.05)
        assert isinstance(miss, int) and miss & slots.TIMED_OUT and not miss & slots.FILES
        table.files_add(1)
        miss = table.take_or_wait("never", 30.0)  # no sleep (nobody rings: a sleep would run out and say so)
        assert isinstance(miss, int) and miss & slots.FILES and not miss & slots.TIMED_OUT
        table.files_add(-1)
        assert table.take_or_wait("\ud800", 1.0) is None  # a key without UTF-8 bytes: the file path's


def test_a_stale_file_path_hint_delays_but_never_loses_a_file_payload(namespace: str) -> None:
    """A hint that reads 0 while a file payload waits (a gc --all replaced the table): a non-blocking get still
    finds it, a waiting get finds it after one sleep slice, and wait_any after its slice."""
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        for key in ("f1", "f2", "f3"):
            a.put(0, 1, key, make_payload(4, 32 * KIB))
        a._slots.files_add(-3)
        assert a._slots.files_add(0) == 0
        res = b.get(0, 1, "f1")  # non-blocking: always looks at the file path
        assert res is not None and payload_matches(res.data, 4, 32 * KIB)
        res = b.get(0, 1, "f2", timeout=5)  # the first sleep runs out its slice, then the file path is tried
        assert res is not None and payload_matches(res.data, 4, 32 * KIB)
        assert b.wait_any(["f3"], 5) == ["f3"]
        assert b.cleanup("f3")


def test_put_encodes_straight_into_the_slot_and_both_encoders_stay_tested(namespace: str) -> None:
    """With the compiled codec a put is one C call (encode into the slot); the pure-Python codec's puts take
    ``Encoded.buffers()`` into the slot; either reads back alike."""
    from omni_plugins.wire import _codec

    impls = ["python", "native"] if _codec.IMPLEMENTATION == "native" else ["python"]
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        for i, impl in enumerate(impls):
            with _codec.use(impl):
                assert a.put(0, 1, f"k{i}", make_payload(i, 4 * KIB)).ok
                assert _published_files(namespace) == [] and len(_busy(a)) == 1
                res = b.get(0, 1, f"k{i}", timeout=5)
            assert res is not None and payload_matches(res.data, i, 4 * KIB)
        with pytest.raises(WireFormatError):
            a.put(0, 1, "bad", {"x": object()})
        assert _busy(a) == [] and _published_files(namespace) == []


@pytest.mark.skipif(wire.IMPLEMENTATION != "native", reason="the compiled codec is not built")
def test_put_obj_encodes_through_the_c_api(namespace: str) -> None:
    """``put_obj`` with the wire encoder's C API stores ``encode``'s bytes, declines a too big encoding (-1) and a
    payload the compiled encoder refuses (DEFERRED) leaving no reserved slot behind, and takes nothing else as
    its encoder."""
    payload = make_payload(3, 4 * KIB)
    with create_connector("shm", _config(namespace)) as a:
        table = a._slots  # type: ignore[attr-defined]
        encoder = wire.native_c_api()
        assert table.put_obj("k", encoder, payload) == wire.encode(payload).nbytes
        got = table.take("k")
        assert isinstance(got, bytearray) and bytes(got) == wire.encode(payload).to_bytes()
        assert table.put_obj("big", encoder, {"x": torch.zeros(1 << 20, dtype=torch.uint8)}) == slots.TOO_BIG
        assert table.put_obj("odd", encoder, {"x": object()}) == slots.DEFERRED
        assert _busy(a) == []
        with pytest.raises(TypeError, match="native_c_api"):
            table.put_obj("k", wire.native_encode_into(), payload)  # a Python-level encoder is not an encoder here
        assert _busy(a) == []
        with pytest.raises(TypeError):
            table.put_obj(7, encoder, payload)  # a key must be a str


def test_a_table_that_cannot_be_set_up_is_not_left_behind(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A C extension older than the Python module (no ``slot_take_or_wait``): construction fails with the error and
    the table, its lock and the rest of the namespace are gone."""
    real = wakeslots._futex

    class Older:
        def __getattr__(self, name: str) -> Any:
            if name == "slot_take_or_wait":
                raise AttributeError(name)
            return getattr(real, name)

    monkeypatch.setattr(wakeslots, "_futex", Older())
    with pytest.raises(AttributeError, match="slot_take_or_wait"):
        create_connector("shm", _config(namespace))
    monkeypatch.undo()
    assert namespace_segments(namespace) == []


def test_an_instance_of_the_other_hand_off_mode_is_refused_at_construction(namespace: str) -> None:
    """With and without the slot table instances cannot see each other's small payloads: whichever starts second
    fails with a ConfigError naming the namespace and the settings, and leaves nothing behind."""
    from omni_plugins_shm import modes

    for first, second in ((_config(namespace), _config(namespace, slot_count=0)), (_config(namespace, slot_count=0), _config(namespace))):
        with create_connector("shm", first) as a:
            with pytest.raises(ConfigError, match=rf"shm namespace '{namespace}'.*slot_count=.*process\(es\) \[{os.getpid()}\]"):
                create_connector("shm", second)
            with create_connector("shm", first) as b:  # the same mode is fine
                assert a.put(0, 1, "k", make_payload(1, KIB)).ok and b.get(0, 1, "k", timeout=5) is not None
            pub = a._pubdir  # type: ignore[attr-defined]
            assert len(os.listdir(pub)) == 2 + (first.get("slot_count", 1) != 0)  # a's marker, wake file (+ table)
        assert not os.path.exists(pub)
    # a marker still empty (a live instance that has not decided yet) or of a dead process does not count
    with create_connector("shm", _config(namespace)) as a:
        me = a._owner  # type: ignore[attr-defined]
        pub, names = a._pubdir, Names(namespace)  # type: ignore[attr-defined]
        undecided = os.path.join(pub, names.marker(me._replace(tag=me.tag ^ 1).token))
        dead = os.path.join(pub, names.marker("1-1-00000001"))
        open(undecided, "wb").close()
        with open(dead, "wb") as fh:
            fh.write(modes.FILES)
        with create_connector("shm", _config(namespace)) as b:
            assert b.get(0, 1, "none") is None
        assert not os.path.exists(dead)  # b's start-up gc removed the dead marker
        os.unlink(undecided)


def test_a_bigger_put_of_an_unconsumed_key_replaces_its_slot_payload(namespace: str) -> None:
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        a.put(0, 1, "k", make_payload(1, KIB))
        a.put(0, 1, "k", make_payload(2, 32 * KIB))  # too big for a slot: the file path, and the slot payload goes
        assert _busy(a) == [] and len(_published_files(namespace)) == 1
        res = b.get(0, 1, "k", timeout=5)
        assert res is not None and payload_matches(res.data, 2, 32 * KIB)
        assert b.get(0, 1, "k") is None


def test_a_tensor_resized_while_encoding_into_a_slot_is_a_typed_error(namespace: str) -> None:
    t = torch.ones(1024)

    class Shrinks(dict):  # type: ignore[type-arg]
        def items(self):  # type: ignore[no-untyped-def]
            t.resize_(4)
            return super().items()

    with create_connector("shm", _config(namespace)) as a:
        with pytest.raises(WireFormatError):
            a.put(0, 1, "k", {"t": t, "d": Shrinks(a=1)})
        assert _busy(a) == [] and _published_files(namespace) == []


def test_full_table_falls_back_to_files(namespace: str) -> None:
    config = _config(namespace, slot_count=4)
    with create_connector("shm", config) as a, create_connector("shm", config) as b:
        for i in range(12):
            assert a.put(0, 1, f"k{i}", make_payload(i, 2 * KIB)).ok
        assert len(_busy(a)) == 4 and len(_published_files(namespace)) == 8
        for i in reversed(range(12)):
            res = b.get(0, 1, f"k{i}", timeout=5)
            assert res is not None and payload_matches(res.data, i, 2 * KIB)
        assert _busy(a) == [] and _published_files(namespace) == []


def test_put_replaces_an_unconsumed_payload_and_cleanup(namespace: str) -> None:
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        a.put(0, 1, "k", make_payload(1, KIB))
        a.put(0, 1, "k", make_payload(2, KIB))
        assert len(_busy(a)) == 1
        res = b.get(0, 1, "k", timeout=5)
        assert res is not None and payload_matches(res.data, 2, KIB)
        a.put(0, 1, "c", make_payload(3, KIB))
        a.put(0, 1, "c-file", make_payload(3, 32 * KIB))
        assert a.cleanup("c") and a.cleanup("c-file")
        assert not a.cleanup("c")
        assert b.get(0, 1, "c") is None and b.get(0, 1, "c-file") is None
        # keys the table cannot hold go to files: too long, lone surrogates
        for key in ("x" * 300, "bad-\udcff"):
            a.put(0, 1, key, make_payload(4, KIB))
            assert _published_files(namespace) and _busy(a) == []
            res = b.get(0, 1, key, timeout=5)
            assert res is not None and payload_matches(res.data, 4, KIB)


def test_close_frees_unconsumed_slots_and_last_instance_removes_the_table(namespace: str) -> None:
    a = create_connector("shm", _config(namespace))
    b = create_connector("shm", _config(namespace))
    a.put(0, 1, "mine", make_payload(1, KIB))
    b.put(0, 1, "theirs", make_payload(2, KIB))
    a.close()
    assert [i.key for i in _busy(b)] == [b"theirs"]  # only what the closing instance published
    table = b._slots.path  # type: ignore[attr-defined]
    assert os.path.exists(table)
    b.close()
    assert not os.path.exists(table)


def test_corrupt_slot_gives_clear_errors(namespace: str) -> None:
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        a.put(0, 1, "len", make_payload(1, KIB))
        a.put(0, 1, "bytes", make_payload(2, KIB))
        mm = a._slots.mm  # type: ignore[attr-defined]
        infos = {i.key: i for i in _busy(a)}

        def at(key: bytes) -> int:
            return a._slots.slot_offset(infos[key].slot)  # type: ignore[attr-defined,no-any-return]

        mm[at(b"len") + 20 : at(b"len") + 24] = (1 << 31).to_bytes(4, "little")  # payload length > slot size
        mm[at(b"bytes") + slots.SLOT_HEADER : at(b"bytes") + slots.SLOT_HEADER + 64] = b"\xff" * 64  # garbage encoding
        with pytest.raises(CorruptPayloadError, match=r"'len'.*corrupt"):
            b.get(0, 1, "len", timeout=1)
        with pytest.raises(WireFormatError, match="'bytes'"):
            b.get(0, 1, "bytes", timeout=1)
        assert _busy(a) == []  # both slots freed, nothing lost but the corrupt payloads


def test_a_damaged_table_header_gives_typed_errors_and_close_still_releases(namespace: str) -> None:
    a = create_connector("shm", _config(namespace))
    b = create_connector("shm", _config(namespace))
    a.put(0, 1, "k", make_payload(1, KIB))
    a._slots.mm[0:4] = b"XXXX"  # type: ignore[attr-defined]  # the table's magic
    with pytest.raises(CorruptPayloadError):
        b.get(0, 1, "k", timeout=1)
    with pytest.raises(ConnectorError, match=r"damaged.*shm gc"):
        a.put(0, 1, "after", make_payload(2, KIB))
    a.close()  # no ValueError: the rest is released regardless
    b.close()  # the namespace (table, wake file, publish directory) is gone: the fixture checks


def test_ttl_expires_slot_payloads_and_gc_ttl(namespace: str) -> None:
    with create_connector("shm", _config(namespace, ttl_seconds=0.2)) as a, create_connector("shm", _config(namespace)) as b:
        a.put(0, 1, "old", make_payload(1, KIB))
        time.sleep(0.5)
        a.put(0, 1, "fresh", make_payload(2, KIB))  # this put reclaims the expired one
        assert b.get(0, 1, "old") is None
        assert a.health()["expired"] == 1
        assert b.get(0, 1, "fresh") is not None
        b.put(0, 1, "other", make_payload(3, KIB))  # b has no ttl: gc --ttl frees it from outside
        time.sleep(0.3)
        report = collect_expired(namespace, 0.2)
        assert len(report.removed) == 1 and _busy(a) == []


def test_expiry_and_gc_ttl_lower_the_file_path_hint(namespace: str) -> None:
    """A counted file payload freed by the producer's ttl or by gc --ttl takes its count off the hint (a hint left
    high would cost every waiting get of the namespace a rename per sleep)."""
    with create_connector("shm", _config(namespace, ttl_seconds=0.2)) as a, create_connector("shm", _config(namespace)) as b:
        hint = b._slots.files_add  # type: ignore[attr-defined]
        a.put(0, 1, "old", make_payload(1, 32 * KIB))
        assert hint(0) == 1
        time.sleep(0.5)
        a.put(0, 1, "fresh", make_payload(2, KIB))  # this put reclaims the expired file payload
        assert a.health()["expired"] == 1 and hint(0) == 0
        assert b.get(0, 1, "fresh") is not None and b.get(0, 1, "old") is None
        b.put(0, 1, "other", make_payload(3, 32 * KIB))  # b has no ttl: gc --ttl frees it from outside
        assert hint(0) == 1
        time.sleep(0.3)
        assert len(collect_expired(namespace, 0.2).removed) == 1
        assert hint(0) == 0 and _published_files(namespace) == []


def test_wait_any_sees_slot_and_file_arrivals(namespace: str, spawn: Any) -> None:
    config = _config(namespace)
    with create_connector("shm", config) as conn:
        assert conn.wait_any(["a", "b"], 0.05) == []
        found: list[list[str]] = []
        waiter = threading.Thread(target=lambda: found.append(conn.wait_any(["w1", "w2"], 60)))
        waiter.start()
        time.sleep(0.2)
        ready, hold = spawn.Queue(), spawn.Event()  # the producer stays open (close frees what it published)
        proc = spawn.Process(target=producer_worker, args=(config, [("w2", 7, KIB)], ready, hold))
        proc.start()
        try:
            assert ready.get(timeout=120) == 1
            waiter.join(60)
            assert found == [["w2"]]
            res = conn.get(0, 1, "w2", timeout=5)
            assert res is not None and payload_matches(res.data, 7, KIB)
        finally:
            hold.set()
            proc.join(JOIN)
        conn.put(0, 1, "f", make_payload(1, 32 * KIB))  # a file-path arrival
        conn.put(0, 1, "s", make_payload(1, KIB))
        assert sorted(conn.wait_any(["f", "s", "none"], 5)) == ["f", "s"]
        assert conn.cleanup("f") and conn.cleanup("s")


def test_concurrent_producers_and_consumers_exactly_once(namespace: str, spawn: Any) -> None:
    """Two producer processes + this one, two consumer processes racing for keys: nothing lost or duplicated.

    Sizes mix slots (1-4 KiB) and files (32 KiB); the table is small (16 slots) so puts also overflow to files.
    """
    config = _config(namespace, slot_count=16)
    sizes = [KIB, 4 * KIB, 32 * KIB, 2 * KIB]
    race_keys = [f"race-{i}" for i in range(40)]
    items = {c: [(f"c{c}-{j}", 100 * c + j, sizes[j % 4]) for j in range(30)] for c in range(2)}
    with create_connector("shm", config) as parent:
        for i, key in enumerate(race_keys):
            assert parent.put(0, 1, key, {"i": torch.tensor(i)}).ok
        out, ready, hold = spawn.Queue(), spawn.Queue(), spawn.Event()  # producers stay open until the consumers are done
        consumers = [spawn.Process(target=pipeline_consumer_worker, args=(config, race_keys, items[c], out)) for c in range(2)]
        # each consumer's items come from a producer process (first half) and from this process (second half)
        producers = [spawn.Process(target=producer_worker, args=(config, items[c][:15], ready, hold)) for c in range(2)]
        procs = [*consumers, *producers]
        for proc in procs:
            proc.start()
        try:
            for c in range(2):
                for key, seed, nbytes in items[c][15:]:
                    assert parent.put(0, 1, key, make_payload(seed, nbytes)).ok
            reports = [out.get(timeout=240) for _ in consumers]
        finally:
            hold.set()
            for proc in procs:
                proc.join(JOIN)
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join(JOIN)
        assert [p.exitcode for p in procs] == [0] * 4
        assert _busy(parent) == []
    won = [k for r in reports for k in r["won"]]
    assert sorted(won) == sorted(race_keys), "each raced key must be taken by exactly one consumer"
    assert [s for r in reports for _, s in r["items"]] == ["ok"] * 60


@pytest.mark.parametrize("stage", ["writing", "claimed"])
def test_sigkilled_mid_write_or_claim_is_reclaimed_by_gc(namespace: str, spawn: Any, stage: str) -> None:
    config = _config(namespace)
    with create_connector("shm", config) as conn:
        ready, sender = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=slot_crash_worker, args=(config, "held", stage, sender))
        proc.start()
        assert ready.poll(120)
        index = ready.recv()
        proc.join(JOIN)
        assert proc.exitcode == -signal.SIGKILL
        busy = _busy(conn)
        assert [i.slot for i in busy] == [index]
        assert slots.word_kind(busy[0].word) == (slots.WRITING if stage == "writing" else slots.CLAIMED)
        # the slot is taken by the dead process: the table keeps working around it
        conn.put(0, 1, "held", make_payload(5, KIB))
        res = conn.get(0, 1, "held", timeout=5)
        assert res is not None and payload_matches(res.data, 5, KIB)
        report = gc.collect(namespace)
        assert f"{Names(namespace).slots()}[slot]" in report.removed
        assert _busy(conn) == []


def test_sigkilled_producer_ready_slots_are_reclaimed(namespace: str, spawn: Any) -> None:
    """READY slots of a dead producer are freed by gc (like its published files); a live one's are kept."""
    config = _config(namespace)
    with create_connector("shm", config) as conn:
        conn.put(0, 1, "live", make_payload(1, KIB))
        ready, hold = spawn.Queue(), spawn.Event()  # never set: the producer hangs until killed
        work = [("dead-0", 2, KIB), ("dead-1", 3, KIB), ("dead-file", 4, 32 * KIB)]  # the last one: the file path
        proc = spawn.Process(target=producer_worker, args=(config, work, ready, hold))
        proc.start()
        assert ready.get(timeout=120) == 3
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(JOIN)
        assert len(_busy(conn)) == 3 and len(_published_files(namespace)) == 1
        assert conn._slots.files_add(0) == 1  # type: ignore[attr-defined]
        gc.collect(namespace)
        assert [i.key for i in _busy(conn)] == [b"live"] and _published_files(namespace) == []
        assert conn._slots.files_add(0) == 0  # type: ignore[attr-defined]  # gc lowered the file-path hint
        out = spawn.Queue()
        consumer = spawn.Process(target=consumer_worker, args=(config, [("live", 1, KIB)], out))
        consumer.start()
        assert out.get(timeout=120) == [("live", "ok")]
        consumer.join(JOIN)


# -- what the file path's tests check for its segments, for the table ------------------------------
def test_slot_table_is_mode_0600(namespace: str) -> None:
    import stat

    with create_connector("shm", _config(namespace)) as a:
        a.put(0, 1, "k", make_payload(1, KIB))
        assert [i.key for i in _busy(a)] == [b"k"]
        assert stat.S_IMODE(os.stat(a._slots.path).st_mode) == 0o600  # type: ignore[attr-defined]
        assert stat.S_IMODE(os.stat(f"/dev/shm/{Names(namespace).publish_dir}").st_mode) == 0o700


def test_corrupt_slot_bytes_raise_wire_format_error_from_get_views(namespace: str) -> None:
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        a.put(0, 1, "k", make_payload(1, KIB))
        mm, info = a._slots.mm, _busy(a)[0]  # type: ignore[attr-defined]
        at = slots.HEADER + info.slot * int.from_bytes(mm[24:32], "little") + slots.SLOT_HEADER
        mm[at : at + 64] = b"\xff" * 64
        with pytest.raises(WireFormatError, match="'k'"):
            b.get_views(0, 1, "k")
        assert _busy(a) == []


def test_gc_keeps_live_slot_payloads(namespace: str) -> None:
    with create_connector("shm", _config(namespace)) as a, create_connector("shm", _config(namespace)) as b:
        a.put(0, 1, "k", make_payload(1, KIB))
        report = gc.collect(namespace)
        assert report.removed == [] and report.errors == []
        got = b.get(0, 1, "k")
        assert got is not None and payload_matches(got.data, 1, KIB)


def test_gc_all_removes_the_table_of_live_instances_and_they_close_cleanly(namespace: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    a = create_connector("shm", _config(namespace))
    a.put(0, 1, "k", make_payload(1, KIB))
    table = a._slots.path  # type: ignore[attr-defined]
    report = gc.collect(namespace, force=True)
    assert os.path.basename(table) in report.removed and namespace_segments(namespace) == []
    a.close()  # closing after a forced gc must not fail (nor recreate anything)
    assert namespace_segments(namespace) == []


@pytest.mark.parametrize("ready", [5, 80], ids=["few-ready-scan", "many-ready-probe"])
def test_present_over_many_keys_answers_as_one_key_at_a_time(namespace: str, ready: int) -> None:
    """``present`` with 64 keys or more reads every slot once (and probes per key again when more than 64 are
    READY): its answer is the one-key-at-a-time answer, READY payloads of the small and a larger class included."""
    config = {"namespace": namespace, "slot_count": 256, "slot_classes": [(4, 2 << 20)]}
    keys = [f"many-{i}" for i in range(1024)]
    with create_connector("shm", config) as producer, create_connector("shm", config) as consumer:
        chosen = [keys[i] for i in range(0, 1024, 1024 // ready)][:ready]
        for key in chosen[:-1]:
            assert producer.put(0, 1, key, make_payload(1, 4 * KIB)).ok
        assert producer.put(0, 1, chosen[-1], make_payload(2, 1 << 20)).ok  # a slot of the larger class
        table = consumer._slots
        by_scan = sorted(keys[i] for i in table.present(keys))
        assert by_scan == sorted(k for k in keys if table.present([k])) == sorted(chosen)
        # a set, or a dict's keys view, is looked up from the READY slots: the same answer, and only keys it holds
        waited = {k: None for k in keys}
        assert sorted(table.ready_among(waited.keys())) == sorted(table.ready_among(set(keys))) == sorted(chosen)
        assert table.ready_among(set(keys) - {chosen[0]}) == [k for k in table.ready_among(set(keys)) if k != chosen[0]]
        assert table.ready_among(set()) == []
        if ready > 64:  # more READY slots than half the keys: the look goes back to probing per key, same answer
            assert consumer._slots._native.slot_ready_among(table.mm, set(chosen)) is None
            assert sorted(table.ready_among(set(chosen))) == sorted(chosen)
            assert sorted(table.ready_among(set(chosen[:40]))) == sorted(chosen[:40])
        for key in chosen:
            assert consumer.get(0, 1, key) is not None
        assert table.present(keys) == [] and table.ready_among(waited.keys()) == []
