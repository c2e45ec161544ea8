"""The slot table's larger size classes (the default geometry): mid-size payloads by compare-and-swap.

A payload takes a slot of the smallest class that holds it, a full class spills into a larger one and
then into the file path; zero-copy views of a larger slot pin it; idle larger slots give their memory
back; crashes mid-put, mid-get and while holding views are reclaimed by gc. Real processes (forkserver)
share one namespace; crashes are real SIGKILLs.
"""

from __future__ import annotations

import gc as pygc
import json
import os
import signal
import time
from typing import Any

import pytest
import torch
from omni_plugins_shm import gc, slots, wakeslots
from omni_plugins_shm.config import ShmConfig
from omni_plugins_shm.naming import Names
from omni_plugins_shm.testing import (
    make_payload,
    namespace_segments,
    payload_matches,
    producer_worker,
    slot_crash_worker,
    stalled_producer_worker,
    view_holder_worker,
)

from omni_plugins import create_connector
from omni_plugins.errors import ConfigError, ConnectorError, CorruptPayloadError

pytestmark = pytest.mark.skipif(not wakeslots.available(), reason="the slot table needs the C extension")

KIB, MIB = 1 << 10, 1 << 20
JOIN = 120


def _table(conn: Any) -> slots.SlotTable:
    return conn._slots  # type: ignore[no-any-return]


def _busy(conn: Any) -> list[tuple[bytes, int, int]]:
    """(key, class, state kind) of every slot that is not FREE."""
    table = _table(conn)
    return sorted((i.key, slots.class_of(table.classes, i.slot), slots.word_kind(i.word)) for i in table.scan())


def _files(namespace: str) -> list[str]:
    names = Names(namespace)
    return [n for n in os.listdir(f"/dev/shm/{names.publish_dir}") if n.startswith((f"{names.prefix}k.", f"{names.prefix}h."))]


def _kill(proc: Any) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(JOIN)


def test_the_default_geometry_has_larger_classes(namespace: str) -> None:
    with create_connector("shm", {"namespace": namespace}) as conn:
        defaults = ShmConfig()
        want = [slots.SlotClass(defaults.slot_count, defaults.slot_bytes), *(slots.SlotClass(n, b) for n, b in defaults.slot_classes)]
        assert _table(conn).classes == want
        assert _table(conn).slot_bytes == want[-1].slot_bytes > 4 * MIB


def test_each_payload_takes_the_smallest_class_that_holds_it(namespace: str) -> None:
    sizes = {"k4k": 4 * KIB, "k64k": 64 * KIB, "k200k": 200 * KIB, "k1m": MIB, "k3m": 3 * MIB, "k9m": 9 * MIB, "k17m": 17 * MIB}
    with create_connector("shm", {"namespace": namespace}) as a, create_connector("shm", {"namespace": namespace}) as b:
        for i, (key, n) in enumerate(sizes.items()):
            assert a.put(0, 1, key, make_payload(i, n)).ok
        ready = slots.READY
        assert _busy(a) == sorted(
            [(b"k4k", 0, ready), (b"k64k", 0, ready), (b"k200k", 1, ready), (b"k1m", 1, ready), (b"k3m", 2, ready), (b"k9m", 3, ready)]
        ), "a 64 KiB tensor and its header fit the small class"
        assert len(_files(namespace)) == 1, "only the payload larger than the largest slot takes the file path"
        for i, (key, n) in enumerate(sizes.items()):
            got = b.get(0, 1, key, timeout=5)
            assert got is not None and payload_matches(got.data, i, n)
            assert b.get(0, 1, key) is None  # consumed once
        assert _busy(a) == [] and _files(namespace) == []


def test_payloads_one_at_a_time_reuse_the_first_slot_of_their_class(namespace: str) -> None:
    """Lowest free slot first: a stream of payloads keeps one slot of the class in use, not one slot per key."""
    with create_connector("shm", {"namespace": namespace}) as a, create_connector("shm", {"namespace": namespace}) as b:
        table = _table(a)
        first = slots.first_slot_for(table.classes, 2 * MIB)
        before = table.committed_bytes()  # the header and the slot headers gc's scan read
        for i in range(12):
            assert a.put(0, 1, f"k{i}", make_payload(i, 2 * MIB)).ok
            assert [info.slot for info in table.scan()] == [first]
            got = b.get(0, 1, f"k{i}", timeout=5)
            assert got is not None and payload_matches(got.data, i, 2 * MIB)
            del got
        # memory: the pages of one large slot, not of twelve (nor of the eight the class has)
        assert table.committed_bytes() - before <= 2 * MIB + 64 * KIB


def test_a_full_class_spills_into_a_larger_one_then_into_the_file_path(namespace: str) -> None:
    config = {"namespace": namespace, "slot_classes": [(2, 256 * KIB), (2, MIB)]}
    with create_connector("shm", config) as a, create_connector("shm", config) as b:
        before = _table(a).committed_bytes()
        for i in range(5):
            assert a.put(0, 1, f"k{i}", make_payload(i, 200 * KIB)).ok
        assert [c for _, c, _ in _busy(a)] == [1, 1, 2, 2]
        assert len(_files(namespace)) == 1
        # only the pages written hold memory: four payloads' worth, not four slots' (the 1 MiB ones are mostly holes),
        # and the small slot the puts tried first (a small slot is had whole: payloads are encoded into it unmeasured)
        assert _table(a).committed_bytes() - before <= 4 * (200 * KIB + 8 * KIB) + ShmConfig().slot_bytes + 4 * KIB
        for i in range(5):
            got = b.get(0, 1, f"k{i}", timeout=5)
            assert got is not None and payload_matches(got.data, i, 200 * KIB)
        assert _busy(a) == [] and _files(namespace) == []


def test_two_producer_processes_with_mixed_sizes_and_a_consumer_holding_views(namespace: str, spawn: Any) -> None:
    """Many payloads of mixed sizes from two producer processes wait at once: the classes fill, the rest takes the
    file path; every payload arrives intact once while the consumer holds some as views; idle slots give their
    memory back afterwards and nothing is left."""
    config = {"namespace": namespace, "slot_idle_seconds": 0.2, "slot_classes": [(16, MIB + 64 * KIB), (8, 4 * MIB + 64 * KIB)]}
    sizes = [4 * KIB, 100 * KIB, 900 * KIB, 3 * MIB, 6 * MIB]
    items = {p: [(f"p{p}-{j}", 100 * p + j, sizes[j % len(sizes)]) for j in range(30)] for p in range(2)}
    with create_connector("shm", config) as consumer:
        table = _table(consumer)
        ready, hold = spawn.Queue(), spawn.Event()
        procs = [spawn.Process(target=producer_worker, args=(config, items[p], ready, hold)) for p in range(2)]
        for proc in procs:
            proc.start()
        try:
            assert [ready.get(timeout=JOIN) for _ in procs] == [30, 30]
            kinds = sorted(c for _, c, _ in _busy(consumer))
            assert kinds == [0] * 12 + [1] * 16 + [2] * 8, "both larger classes full"
            assert len(_files(namespace)) == 60 - len(kinds), "the rest (every 6 MiB payload among them) waits on the file path"
            held = []
            for p in range(2):
                for j, (key, seed, nbytes) in enumerate(items[p]):
                    got = consumer.get_views(0, 1, key, timeout=30) if j % 4 == 0 else consumer.get(0, 1, key, timeout=30)
                    assert got is not None and payload_matches(got.data, seed, nbytes), key
                    if j % 4 == 0:
                        held.append(got)
            assert _files(namespace) == [] and all(kind == slots.CLAIMED for _, _, kind in _busy(consumer))
            del held, got
            pygc.collect()
            assert _busy(consumer) == []
            assert table.ready_counts() == [0, 0], "every READY slot counted in was counted out"
        finally:
            hold.set()
            for proc in procs:
                proc.join(JOIN)
                _kill(proc)
        assert [proc.exitcode for proc in procs] == [0, 0]
        time.sleep(0.5)
        gc.collect(namespace)
        rows, _ = slots.layout(table.classes)
        small_region, larger_slots = rows[1][4], sum(row[0] for row in rows[1:])
        # idle larger slots gave their memory back: what is left is the small class and one header page per larger slot
        assert table.committed_bytes() <= small_region + larger_slots * slots.PAGE


def test_a_put_replaces_an_unconsumed_payload_in_another_class(namespace: str) -> None:
    with create_connector("shm", {"namespace": namespace}) as a, create_connector("shm", {"namespace": namespace}) as b:
        a.put(0, 1, "k", make_payload(1, 2 * MIB))
        a.put(0, 1, "k", make_payload(2, KIB))  # the small one replaces the large one
        assert [(key, c) for key, c, _ in _busy(a)] == [(b"k", 0)]
        got = b.get(0, 1, "k", timeout=5)
        assert got is not None and payload_matches(got.data, 2, KIB)
        a.put(0, 1, "k", make_payload(3, KIB))
        a.put(0, 1, "k", make_payload(4, 300 * KIB))  # and the other way round
        assert [(key, c) for key, c, _ in _busy(a)] == [(b"k", 1)]
        got = b.get(0, 1, "k", timeout=5)
        assert got is not None and payload_matches(got.data, 4, 300 * KIB)
        assert b.get(0, 1, "k") is None and _busy(a) == []


def test_views_of_a_larger_slot_pin_it_until_the_last_view_dies(namespace: str) -> None:
    with create_connector("shm", {"namespace": namespace}) as a, create_connector("shm", {"namespace": namespace}) as b:
        a.put(0, 1, "a", make_payload(1, 512 * KIB))
        res = b.get_views(0, 1, "a", timeout=5)
        assert res is not None and payload_matches(res.data, 1, 512 * KIB)
        x = res.data["x"]
        del res
        pygc.collect()
        assert _busy(a) == [(b"a", 1, slots.CLAIMED)], "the surviving view keeps the slot claimed"
        for i in range(3):  # the next puts take other slots: the viewed bytes stay as they were
            a.put(0, 1, f"b{i}", make_payload(100 + i, 512 * KIB))
            got = b.get(0, 1, f"b{i}", timeout=5)
            assert got is not None and payload_matches(got.data, 100 + i, 512 * KIB)
        assert torch.equal(x, make_payload(1, 512 * KIB)["x"]), "a live view was overwritten"  # type: ignore[arg-type]
        del x, got
        pygc.collect()
        assert _busy(a) == []
        # small payloads are copied out for views too (a view must not pin a small slot)
        a.put(0, 1, "s", make_payload(2, KIB))
        small = b.get_views(0, 1, "s", timeout=5)
        assert small is not None and _busy(a) == []


def test_zero_copy_config_gets_views_of_larger_slots(namespace: str) -> None:
    with (
        create_connector("shm", {"namespace": namespace}) as a,
        create_connector("shm", {"namespace": namespace, "zero_copy": True}) as b,
    ):
        a.put(0, 1, "k", make_payload(1, 2 * MIB))
        got = b.get(0, 1, "k", timeout=5)
        assert got is not None and payload_matches(got.data, 1, 2 * MIB)
        assert _busy(a) == [(b"k", 2, slots.CLAIMED)]
        del got
        pygc.collect()
        assert _busy(a) == []


def test_views_of_a_larger_slot_outlive_close_of_both_connectors(namespace: str) -> None:
    a = create_connector("shm", {"namespace": namespace})
    b = create_connector("shm", {"namespace": namespace})
    a.put(0, 1, "k", make_payload(5, 700 * KIB))
    res = b.get_views(0, 1, "k", timeout=5)
    a.close()
    b.close()
    assert namespace_segments(namespace) == [], "the table goes with the last instance; its mapping stays while viewed"
    assert res is not None and payload_matches(res.data, 5, 700 * KIB)
    del res
    pygc.collect()


def test_idle_larger_slots_give_their_memory_back(namespace: str) -> None:
    """A slot of a larger class left FREE for slot_idle_seconds loses its pages: at a later put, or at gc."""
    config = {"namespace": namespace, "slot_idle_seconds": 0.2}
    with create_connector("shm", config) as a, create_connector("shm", config) as b:
        table = _table(a)
        before = table.committed_bytes()
        a.put(0, 1, "big", make_payload(1, 3 * MIB))
        assert b.get(0, 1, "big", timeout=5) is not None
        assert table.committed_bytes() >= before + 3 * MIB
        time.sleep(0.5)  # longer than slot_idle_seconds (and the put's check interval)
        a.put(0, 1, "small", make_payload(2, KIB))  # a put whose check is due trims the idle slot
        assert table.committed_bytes() <= before + 64 * KIB
        assert b.get(0, 1, "small", timeout=5) is not None
        # a trimmed slot holds a payload again (its pages fault in anew)
        a.put(0, 1, "again", make_payload(3, 3 * MIB))
        got = b.get(0, 1, "again", timeout=5)
        assert got is not None and payload_matches(got.data, 3, 3 * MIB)
        del got
        assert table.committed_bytes() >= before + 3 * MIB
        time.sleep(0.5)
        report = gc.collect(namespace)  # gc trims too (an idle namespace gets its memory back without a put)
        assert report.bytes_freed >= 3 * MIB and table.committed_bytes() <= before + 64 * KIB


@pytest.mark.parametrize("wait", ["get", "wait_any"])
def test_a_quiet_namespace_gives_idle_memory_back_while_its_consumers_wait(namespace: str, wait: str) -> None:
    """No put, no gc: a wait whose 0.5 s slice runs out trims what is due."""
    config = {"namespace": namespace, "slot_idle_seconds": 0.1}
    with create_connector("shm", config) as a, create_connector("shm", config) as b:
        table = _table(a)
        before = table.committed_bytes()
        a.put(0, 1, "big", make_payload(1, 3 * MIB))
        assert b.get(0, 1, "big", timeout=5) is not None
        assert table.committed_bytes() >= before + 3 * MIB
        time.sleep(0.3)  # longer than slot_idle_seconds: the slot is due once a check runs
        if wait == "get":
            assert b.get(0, 1, "never", timeout=0.7) is None  # a 0.5 s slice runs out
        else:
            assert b.wait_any(["never"], 0.7) == []
        assert table.committed_bytes() <= before + 64 * KIB


def test_slot_idle_seconds_zero_keeps_the_pages(namespace: str) -> None:
    config = {"namespace": namespace, "slot_idle_seconds": 0}
    with create_connector("shm", config) as a, create_connector("shm", config) as b:
        table = _table(a)
        a.put(0, 1, "big", make_payload(1, 3 * MIB))
        assert b.get(0, 1, "big", timeout=5) is not None
        held = table.committed_bytes()
        time.sleep(0.3)
        a.put(0, 1, "small", make_payload(2, KIB))
        gc.collect(namespace)
        assert table.committed_bytes() >= held and b.get(0, 1, "small", timeout=5) is not None


def test_lent_slots_are_not_trimmed(namespace: str) -> None:
    config = {"namespace": namespace, "slot_idle_seconds": 0.05}
    with create_connector("shm", config) as a, create_connector("shm", config) as b:
        a.put(0, 1, "k", make_payload(1, 3 * MIB))
        views = b.get_views(0, 1, "k", timeout=5)
        time.sleep(0.3)
        assert _table(a).trim(time.time()) == 0 and gc.collect(namespace).bytes_freed == 0
        assert views is not None and payload_matches(views.data, 1, 3 * MIB)
        del views
        pygc.collect()
        assert _table(a).trim(time.time()) >= 3 * MIB


@pytest.mark.parametrize("stage", ["writing", "claimed"])
def test_a_process_killed_holding_a_larger_slot_is_reclaimed_by_gc(namespace: str, spawn: Any, stage: str) -> None:
    """SIGKILL between the CAS that takes a larger slot and its release (mid-put, mid-copy-out): gc frees the slot."""
    config = {"namespace": namespace, "slot_classes": [(1, MIB + 64 * KIB)]}  # one larger slot: the crash takes it
    with create_connector("shm", config) as live, create_connector("shm", config) as consumer:
        recv, send = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=slot_crash_worker, args=(config, "lost", stage, send, 512 * KIB))
        proc.start()
        try:
            assert recv.poll(JOIN)
            index = recv.recv()
            proc.join(JOIN)
            assert proc.exitcode == -signal.SIGKILL
        finally:
            _kill(proc)
        assert slots.class_of(_table(live).classes, index) == 1
        assert live.put(0, 1, "next", make_payload(2, 512 * KIB)).ok
        assert _files(namespace), "the class's only slot is held by the dead process: the file path takes over"
        assert consumer.get(0, 1, "next", timeout=5) is not None
        report = gc.collect(namespace)
        assert sum(n.endswith("[slot]") for n in report.removed) == 1
        assert live.put(0, 1, "after", make_payload(3, 512 * KIB)).ok and _files(namespace) == []
        assert [(key, c) for key, c, _ in _busy(live)] == [(b"after", 1)], "the freed slot holds payloads again"
        got = consumer.get(0, 1, "after", timeout=5)
        assert got is not None and payload_matches(got.data, 3, 512 * KIB)
        assert consumer.get(0, 1, "lost") is None


def test_a_consumer_killed_holding_views_of_a_larger_slot_is_reclaimed_by_gc(namespace: str, spawn: Any) -> None:
    config = {"namespace": namespace}
    with create_connector("shm", config) as producer:
        assert producer.put(0, 1, "held", make_payload(7, 512 * KIB)).ok
        ready = spawn.Queue()
        proc = spawn.Process(target=view_holder_worker, args=(config, "held", ready))
        proc.start()
        try:
            assert ready.get(timeout=JOIN) is True
            assert _busy(producer) == [(b"held", 1, slots.CLAIMED)]
            assert gc.collect(namespace).removed == [], "a live consumer's lent slot must be kept"
        finally:
            _kill(proc)
        report = gc.collect(namespace)
        assert sum(n.endswith("[slot]") for n in report.removed) == 1 and _busy(producer) == []
        assert any(".o." in n for n in report.removed), "the dead consumer's marker goes too"
        assert producer.put(0, 1, "again", make_payload(8, 512 * KIB)).ok
        got = producer.get(0, 1, "again", timeout=5)
        assert got is not None and payload_matches(got.data, 8, 512 * KIB)


def test_views_of_a_larger_slot_outlive_a_sigkilled_producer(namespace: str, spawn: Any) -> None:
    """The producer dies with payloads in larger slots: gc frees its READY slots, keeps the one we view."""
    config = {"namespace": namespace}
    ready = spawn.Queue()
    proc = spawn.Process(target=stalled_producer_worker, args=(config, 4, 300 * KIB, ready))
    proc.start()
    try:
        assert ready.get(timeout=JOIN) == 4
        with create_connector("shm", {**config, "reclaim_on_start": False}) as consumer:
            views = consumer.get_views(0, 1, "stalled-0", timeout=30)
            owned = consumer.get(0, 1, "stalled-1", timeout=30)
            assert views is not None and owned is not None
            _kill(proc)
            report = gc.collect(namespace)
            assert sum(n.endswith("[slot]") for n in report.removed) == 2, "the two unconsumed payloads of the dead producer"
            assert _busy(consumer) == [(b"stalled-0", 1, slots.CLAIMED)]
            assert payload_matches(views.data, 0, 300 * KIB) and payload_matches(owned.data, 1, 300 * KIB)
            del views
            pygc.collect()
            assert _busy(consumer) == []
    finally:
        _kill(proc)


def test_ttl_expires_payloads_of_larger_slots(namespace: str) -> None:
    with (
        create_connector("shm", {"namespace": namespace, "ttl_seconds": 0.2}) as a,
        create_connector("shm", {"namespace": namespace}) as b,
    ):
        a.put(0, 1, "old", make_payload(1, 2 * MIB))
        time.sleep(0.5)
        a.put(0, 1, "fresh", make_payload(2, 2 * MIB))  # this put reclaims the expired one
        assert b.get(0, 1, "old") is None and a.health()["expired"] == 1
        got = b.get(0, 1, "fresh", timeout=5)
        assert got is not None and payload_matches(got.data, 2, 2 * MIB)


def test_the_first_instance_sets_the_geometry(namespace: str) -> None:
    with (
        create_connector("shm", {"namespace": namespace, "slot_classes": [(3, 200 * KIB)]}) as a,
        create_connector("shm", {"namespace": namespace}) as b,
    ):
        assert _table(b).classes == _table(a).classes == [slots.SlotClass(256, 68 * KIB), slots.SlotClass(3, 200 * KIB)]
        b.put(0, 1, "k", make_payload(1, MIB))  # larger than b's table holds: the file path
        assert len(_files(namespace)) == 1
        got = a.get(0, 1, "k", timeout=5)
        assert got is not None and payload_matches(got.data, 1, MIB)


def test_classes_that_do_not_ascend_are_a_config_error(namespace: str) -> None:
    for bad in ([(4, 64 * KIB)], [(4, 2 * MIB), (4, MIB)], [(0, MIB)], [(1, MIB), (1, 2 * MIB), (1, 3 * MIB), (1, 4 * MIB)]):
        with pytest.raises(ConfigError, match="slot_classes"):
            create_connector("shm", {"namespace": namespace, "slot_classes": bad})
    assert namespace_segments(namespace) == []


def test_a_damaged_class_table_is_refused(namespace: str) -> None:
    a = create_connector("shm", {"namespace": namespace})
    a.put(0, 1, "k", make_payload(1, MIB))
    table = _table(a)
    table.mm[slots._CLASS_OFF + slots._CLASS.size + 16 : slots._CLASS_OFF + slots._CLASS.size + 24] = (1 << 40).to_bytes(8, "little")
    with pytest.raises(ConnectorError, match="invalid header"):
        create_connector("shm", {"namespace": namespace})
    with pytest.raises(CorruptPayloadError):
        a.get(0, 1, "k", timeout=1)
    with pytest.raises(ConnectorError, match=r"damaged.*shm gc"):
        a.put(0, 1, "after", make_payload(2, KIB))
    a.close()


_FULL_TMPFS_CHILD = r"""
import json, os, sys
import torch
from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

shm_dir = sys.argv[1]
a = create_connector("shm", {"namespace": "full", "shm_dir": shm_dir})
b = create_connector("shm", {"namespace": "full", "shm_dir": shm_dir})
out = []
for key in ("k1", "k2", "k3"):
    try:
        a.put(0, 1, key, {"t": torch.full((3 << 20,), 7, dtype=torch.uint8)})
        out.append("ok")
    except ConnectorError as exc:
        out.append("ENOSPC" if "No space left" in str(exc) else str(exc))
got = b.get(0, 1, "k1", timeout=5)
out.append(bool(got is not None and int(got.data["t"].sum()) == 7 * (3 << 20)))
del got
a.put(0, 1, "k4", {"t": torch.ones(3 << 20, dtype=torch.uint8)})
out.append(b.get(0, 1, "k4", timeout=5) is not None and b.get(0, 1, "k2", timeout=5) is not None)
a.close()
b.close()
out.append(os.listdir(shm_dir))
print(json.dumps(out))
"""


def test_a_full_tmpfs_is_an_error_not_a_sigbus(tmp_path: Any) -> None:
    """A container's small /dev/shm: a slot's pages are had before it is written (an ENOSPC error on the file path,
    never a SIGBUS in the table), and the table's headers exist from its creation. A 9 MiB tmpfs in a mount
    namespace of a child process holds the table's headers and two 3 MiB payloads, not three."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs in a mount namespace")
    mount = 'mount -t tmpfs -o size=9m tmpfs "$0" && exec "$@"'
    argv = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, str(tmp_path), sys.executable, "-c", _FULL_TMPFS_CHILD]
    proc = subprocess.run([*argv, str(tmp_path)], capture_output=True, text=True, timeout=JOIN)
    if proc.returncode != 0 and ("unshare" in proc.stderr or "mount" in proc.stderr) and "Traceback" not in proc.stderr:
        pytest.skip(f"no user + mount namespaces here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, f"exit {proc.returncode} (a SIGBUS is -7): {proc.stderr[-2000:]}"
    assert json.loads(proc.stdout.splitlines()[-1]) == ["ok", "ok", "ENOSPC", True, True, []]
