"""Futex wake-ups (``wakeslots`` + the C extension ``_native``) and their fallbacks.

The wake file is a doorbell only: these tests check that a blocked get is woken by the ring,
that it still gets its payload when a ring is lost (producer SIGKILLed between its publishing
rename and its ring), that a consumer SIGKILLed while waiting harms nobody, that the wake file
lives exactly as long as the namespace's live instances, and that the inotify path (no C
extension, or ``futex_wait: false``) behaves the same.
"""

from __future__ import annotations

import mmap
import os
import signal
import stat
import struct
import threading
import time
from typing import Any

import pytest
from omni_plugins_shm import gc, wakeslots
from omni_plugins_shm.naming import KeyNames, Names
from omni_plugins_shm.testing import (
    killed_after_publish_worker,
    namespace_segments,
    payload_matches,
    waiting_consumer_worker,
)

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

native = pytest.importorskip("omni_plugins_shm._native", reason="the optional C extension is not built")

JOIN = 120


def _wake_path(namespace: str) -> str:
    names = Names(namespace)
    return f"/dev/shm/{names.publish_dir}/{names.wake()}"


def _slot(namespace: str, key: str) -> int:
    names = Names(namespace)
    return KeyNames(names, f"/dev/shm/{names.publish_dir}", key).wake_slot


def _words(namespace: str, offset: int) -> tuple[int, int]:
    """``(seq, waiters)`` of one wake slot, read from the file."""
    with open(_wake_path(namespace), "rb") as fh:
        fh.seek(offset)
        return struct.unpack("<II", fh.read(8))  # type: ignore[return-value]


def _until(cond: Any, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# -- the C extension on its own ---------------------------------------------------------------
def test_native_wait_reports_timeout_change_and_wake() -> None:
    mm = mmap.mmap(-1, 4096)
    assert native.load(mm, 64) == 0
    assert native.wait(mm, 64, 0, 0.01) is False  # nothing rang: timeout
    assert native.wait(mm, 64, 7, 5.0) is True  # the value differs already: no sleep
    assert native.bump(mm, 64) is False and native.load(mm, 64) == 1  # nobody waits: no FUTEX_WAKE
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(native.wait(mm, 64, 1, 60.0)))
    waiter.start()
    _until(lambda: struct.unpack_from("<I", mm, 68)[0] == 1, "the waiter to register")
    assert native.bump(mm, 64) is True  # a waiter: FUTEX_WAKE issued
    waiter.join(JOIN)
    assert woke == [True] and struct.unpack_from("<I", mm, 68)[0] == 0


@pytest.mark.parametrize("offset", [-4, 2, 4090, 4096])
def test_native_rejects_bad_slots(offset: int) -> None:
    mm = mmap.mmap(-1, 4096)
    for call in (lambda: native.load(mm, offset), lambda: native.bump(mm, offset), lambda: native.wait(mm, offset, 0, 0.0)):
        with pytest.raises(ValueError, match="slot"):
            call()
    with pytest.raises(BufferError):
        native.bump(b"read-only bytes", 0)
    with pytest.raises(ValueError, match="seconds"):
        native.wait(mm, 0, 0, -1.0)


def test_native_rename_noreplace_matches_the_ctypes_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Differential: the C and the ctypes renameat2 give the same outcomes and exception types."""
    from omni_plugins_shm.segments import files

    outcomes = []
    for impl in ("native", "ctypes"):
        if impl == "ctypes":
            monkeypatch.setattr(files, "_native_rename", None)
        d = tmp_path / impl
        d.mkdir()
        (d / "a").write_bytes(b"a")
        (d / "b").write_bytes(b"b")
        got = []
        for src, dst in (("a", "b"), ("a", "c"), ("a", "d"), ("missing", "e")):
            try:
                files.rename_noreplace(str(d / src), str(d / dst))
                got.append("ok")
            except OSError as exc:
                got.append(type(exc).__name__)
        outcomes.append((got, sorted(p.name for p in d.iterdir()), (d / "b").read_bytes(), (d / "c").read_bytes()))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == ["FileExistsError", "ok", "FileNotFoundError", "FileNotFoundError"]


# -- the wake file ---------------------------------------------------------------------------
def test_wake_file_is_private_shared_and_removed_by_the_last_instance(namespace: str) -> None:
    first = create_connector("shm", {"namespace": namespace})
    second = create_connector("shm", {"namespace": namespace})
    path = _wake_path(namespace)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert first._wake.path == second._wake.path == path  # type: ignore[attr-defined]
    seq, _ = _words(namespace, _slot(namespace, "k"))
    second.put(0, 1, "k", {"v": 1})
    assert _words(namespace, _slot(namespace, "k"))[0] == seq + 1  # the put rang the key's slot
    first.close()
    assert os.path.exists(path), "a live instance holds the wake file"
    assert gc.collect(namespace).removed == [] and os.path.exists(path), "gc must keep a held wake file"
    assert second.get(0, 1, "k").data == {"v": 1}  # type: ignore[union-attr]
    second.close()
    assert not os.path.exists(path)


def test_orphaned_wake_file_is_reclaimed_by_gc_and_a_foreign_one_refused(namespace: str) -> None:
    with create_connector("shm", {"namespace": namespace}):
        pass
    pubdir = f"/dev/shm/{Names(namespace).publish_dir}"
    os.mkdir(pubdir, 0o700)
    path = _wake_path(namespace)
    with open(path, "wb") as fh:  # what a SIGKILLed last instance leaves (nobody holds its lock)
        fh.write(wakeslots.MAGIC)
    assert namespace_segments(namespace) == [Names(namespace).wake()]
    gc.collect(namespace)
    assert namespace_segments(namespace) == []
    os.mkdir(pubdir, 0o700)
    with open(path, "wb") as fh:
        fh.write(b"NOTAWAKE" + bytes(64))
    try:
        with pytest.raises(ConnectorError, match=r"wake file .* unknown contents"):
            create_connector("shm", {"namespace": namespace, "reclaim_on_start": False})  # (gc would take it)
    finally:
        os.unlink(path)
        os.rmdir(pubdir)


def test_instances_opening_and_closing_concurrently_always_share_one_wake_file(namespace: str) -> None:
    """The flock lifecycle under churn: every live instance's wake file is the one at the path.

    Three threads open and close instances of one namespace (the last one out removes the file and
    the publish directory, the next one in creates them again); each checks, while open, that the
    file it mapped is the file at the path -- the invariant that makes every producer ring the
    wake file every waiter sleeps on.
    """
    path = _wake_path(namespace)
    errors: list[str] = []

    def churn() -> None:
        try:
            for _ in range(12):
                with create_connector("shm", {"namespace": namespace, "reclaim_on_start": False}) as conn:
                    mine = os.fstat(conn._wake._fd)  # type: ignore[attr-defined]
                    if not os.path.samestat(mine, os.stat(path)):
                        errors.append("an open instance's wake file is not the one at the path")
        except Exception as exc:  # e.g. the publish directory vanishing under an opening instance
            errors.append(repr(exc))

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN)
    assert errors == []
    assert not os.path.exists(path)


def test_publish_directory_removed_between_mkdir_and_check_is_created_again(namespace: str, monkeypatch: Any) -> None:
    """Fault injection: the last other instance's close removes the publish directory right after our mkdir."""
    from omni_plugins_shm import pubdir

    real_lstat, raced = os.lstat, []

    def lstat(path: str) -> os.stat_result:
        if not raced and path.endswith(".d"):
            raced.append(path)
            os.rmdir(path)  # what a concurrent remove_if_empty does
        return real_lstat(path)

    monkeypatch.setattr(pubdir.os, "lstat", lstat)
    with create_connector("shm", {"namespace": namespace}) as conn:
        assert raced and os.path.isdir(raced[0])
        conn.put(0, 1, "k", {"v": 1})
        got = conn.get(0, 1, "k")
        assert got is not None and got.data == {"v": 1}


# -- waiting, both paths -----------------------------------------------------------------------
@pytest.mark.parametrize("futex_wait", [True, False], ids=["futex", "inotify"])
def test_blocked_get_is_woken_and_ignores_other_keys(namespace: str, futex_wait: bool) -> None:
    """Keys sharing the waiter's slot ring it too (spurious wake-ups): the waiter goes back to sleep."""
    config = {"namespace": namespace, "futex_wait": futex_wait}
    with create_connector("shm", config) as producer, create_connector("shm", config) as consumer:
        assert consumer._wake.futex_waits is futex_wait  # type: ignore[attr-defined]
        slot = _slot(namespace, "mine")
        same_slot = [k for k in (f"o{i}" for i in range(5000)) if _slot(namespace, k) == slot][:3]
        assert len(same_slot) == 3
        timer = threading.Timer(0.05, lambda: [producer.put(0, 1, k, {"k": k}) for k in same_slot])
        timer.start()
        assert consumer.get(0, 1, "mine", timeout=0.4) is None
        timer.join()
        result: list[Any] = []
        waiter = threading.Thread(target=lambda: result.append(consumer.get(0, 1, "mine", timeout=60)))
        waiter.start()
        if futex_wait:
            _until(lambda: _words(namespace, slot)[1] == 1, "the get to sleep on its slot")
        producer.put(0, 1, "mine", {"v": 1})
        waiter.join(JOIN)
        assert result and result[0] is not None and result[0].data == {"v": 1}
        for k in same_slot:
            assert consumer.get(0, 1, k).data == {"k": k}  # type: ignore[union-attr]


def test_producer_without_the_extension_still_rings(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixed installs: a pure-Python producer bumps the slot and FUTEX_WAKEs through ctypes (the consumer runs
    without the slot table too: a namespace has one hand-off mode)."""
    with create_connector("shm", {"namespace": namespace, "slot_count": 0}) as consumer:
        monkeypatch.setattr(wakeslots, "_futex", None)
        with create_connector("shm", {"namespace": namespace}) as producer:
            monkeypatch.undo()
            assert not producer._wake.futex_waits and consumer._wake.futex_waits  # type: ignore[attr-defined]
            slot = _slot(namespace, "k")
            seen = consumer._wake.seq(slot)  # type: ignore[attr-defined]
            woke: list[bool] = []
            waiter = threading.Thread(target=lambda: woke.append(native.wait(consumer._wake.mm, slot, seen, 60.0)))  # type: ignore[attr-defined]
            waiter.start()
            _until(lambda: _words(namespace, slot)[1] == 1, "the waiter to sleep")
            time.sleep(0.2)  # registered; give it time to enter FUTEX_WAIT (else the ring finds it awake: no test)
            producer.put(0, 1, "k", {"v": 1})
            waiter.join(JOIN)
            assert woke == [True], "the ctypes ring must wake a futex sleeper (False = it slept to the timeout)"
            assert consumer._wake.seq(slot) == seen + 1  # type: ignore[attr-defined]
            assert consumer.get(0, 1, "k").data == {"v": 1}  # type: ignore[union-attr]


# -- crashes (real processes) ------------------------------------------------------------------
def test_consumer_killed_while_waiting(namespace: str, spawn: Any) -> None:
    """A SIGKILLed waiter leaves its slot's waiter count raised: producers ring in vain, nothing breaks or leaks."""
    config = {"namespace": namespace}
    with create_connector("shm", config) as producer:
        slot = _slot(namespace, "never")
        ready = spawn.Queue()
        proc = spawn.Process(target=waiting_consumer_worker, args=(config, "never", ready))
        proc.start()
        try:
            token = ready.get(timeout=JOIN)
            _until(lambda: _words(namespace, slot)[1] == 1, "the child to sleep in its get")
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(JOIN)
        assert _words(namespace, slot)[1] == 1, "the dead waiter's count stays (documented)"
        report = gc.collect(namespace)
        assert any(token in n for n in report.removed), "the dead consumer's marker must go"
        with create_connector("shm", config) as consumer:
            result: list[Any] = []
            waiter = threading.Thread(target=lambda: result.append(consumer.get(0, 1, "never", timeout=60)))
            waiter.start()
            _until(lambda: _words(namespace, slot)[1] == 2, "a live waiter next to the dead count")
            producer.put(0, 1, "never", {"v": 2})
            waiter.join(JOIN)
            assert result and result[0].data == {"v": 2}
    assert namespace_segments(namespace) == []


def test_producer_killed_between_publish_and_ring(namespace: str, spawn: Any) -> None:
    """The ring is lost with the producer; the waiting get still finds the payload (its safety re-check)."""
    # the table on, the payload larger than its slots: the file path, whose publishing rename the fault follows
    config = {"namespace": namespace, "slot_bytes": 16 << 10, "slot_classes": []}
    with create_connector("shm", config) as consumer:
        slot = _slot(namespace, "orphan")
        seq_before = _words(namespace, slot)[0]
        result: list[Any] = []
        waiter = threading.Thread(target=lambda: result.append(consumer.get(0, 1, "orphan", timeout=60)))
        waiter.start()
        proc = spawn.Process(target=killed_after_publish_worker, args=(config, "orphan", 9, 64 << 10))
        proc.start()
        proc.join(JOIN)
        waiter.join(JOIN)
        assert proc.exitcode == -signal.SIGKILL
        assert _words(namespace, slot)[0] == seq_before, "the producer died before ringing"
        assert result and result[0] is not None and payload_matches(result[0].data, 9, 64 << 10)
        result.clear()  # drop the owned result before gc and the leak check
        report = gc.collect(namespace)
        assert report.removed and all(f".{proc.pid}-" in n for n in report.removed)
        assert [n for n in namespace_segments(namespace) if f".{proc.pid}-" in n] == []
    assert namespace_segments(namespace) == []


def test_close_while_a_get_sleeps_on_the_wake_file(namespace: str) -> None:
    """Close while another thread sleeps on the wake file: the sleeper returns None, nothing leaks."""
    consumer = create_connector("shm", {"namespace": namespace})
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(consumer.get(0, 1, "late", timeout=30)))
    waiter.start()
    slot = _slot(namespace, "late")
    _until(lambda: _words(namespace, slot)[1] == 1, "the get to sleep")
    consumer.close()
    waiter.join(JOIN)
    assert result == [None]
