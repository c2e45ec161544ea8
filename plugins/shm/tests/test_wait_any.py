"""``ShmConnector.wait_any``: inotify-backed wait for any of several keys (real /dev/shm, real processes)."""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import pytest
import torch
from omni_plugins_shm import notify
from omni_plugins_shm.testing import make_payload, payload_matches, producer_worker

from omni_plugins import create_connector

JOIN = 120


def test_capability_is_advertised(pair: Any) -> None:
    assert pair[1].capabilities.wait_any is True


@pytest.mark.parametrize("method", ["wait_any", "poll_any"])
def test_keys_put_by_another_process(namespace: str, spawn: Any, method: str) -> None:
    """Both waits see keys another process puts (``poll_any``: polls of at most 20 ms, repeated as a runtime would)."""
    config = {"namespace": namespace}
    keys = [f"req{i}_0_0" for i in range(20)]
    items = [(keys[i], i, 3000) for i in (17, 2, 9)]
    ready, hold = spawn.Queue(), spawn.Event()
    proc = spawn.Process(target=producer_worker, args=(config, items, ready, hold))
    with create_connector("shm", config) as conn:
        wait = getattr(conn, method)
        proc.start()
        try:
            found: dict[str, bool] = {}
            deadline = time.monotonic() + 60
            while len(found) < len(items) and time.monotonic() < deadline:
                ready_keys = wait([k for k in keys if k not in found], timeout=max(0.0, deadline - time.monotonic()))
                if method == "wait_any":  # one wait of up to 60 s returns at least one key
                    assert ready_keys, "nothing arrived within 60 s"
                assert set(ready_keys) <= set(keys)
                for key in ready_keys:
                    res = conn.get(0, 1, key)
                    seed = next(s for k, s, _ in items if k == key)
                    found[key] = res is not None and payload_matches(res.data, seed, 3000)
            assert found == {k: True for k, _, _ in items}
            assert wait(keys, timeout=0.05) == []  # all consumed
        finally:
            hold.set()
            proc.join(JOIN)
    assert proc.exitcode == 0


def test_unrelated_traffic_is_not_reported(pair: Any) -> None:
    producer, consumer = pair
    stop = threading.Event()
    other = create_connector("shm", {"namespace": consumer.config.namespace})

    def churn() -> None:  # puts and consumes other keys in the same directory while we wait
        i = 0
        while not stop.is_set():
            producer.put(0, 1, f"other_{i}", {"v": torch.ones(4)})
            assert other.get(0, 1, f"other_{i}", timeout=5) is not None
            i += 1

    th = threading.Thread(target=churn)
    th.start()
    try:
        assert consumer.wait_any([f"wanted_{i}" for i in range(8)], timeout=0.3) == []
    finally:
        stop.set()
        th.join(30)
        other.close()


def test_published_before_the_first_wait_and_hashed_keys(pair: Any) -> None:
    producer, consumer = pair
    odd = "stage/out put:" + "x" * 300  # hashed name (unsafe characters, too long)
    assert producer.put(0, 1, odd, make_payload(3, 100)).ok
    assert producer.put(0, 1, "plain_0_0", make_payload(4, 100)).ok
    ready = consumer.wait_any([odd, "absent", "plain_0_0"], timeout=10)
    assert sorted(ready) == sorted([odd, "plain_0_0"])
    for key, seed in ((odd, 3), ("plain_0_0", 4)):
        res = consumer.get(0, 1, key)
        assert res is not None and payload_matches(res.data, seed, 100)


def test_key_taken_by_another_consumer_is_not_reported(pair: Any) -> None:
    producer, consumer = pair
    rival = create_connector("shm", {"namespace": consumer.config.namespace})
    try:
        assert consumer.wait_any(["k_0_0"], timeout=0.01) == []  # tracking starts
        assert producer.put(0, 1, "k_0_0", {"v": torch.ones(2)}).ok
        assert rival.get(0, 1, "k_0_0", timeout=5) is not None
        assert consumer.wait_any(["k_0_0"], timeout=0.05) == []
        assert producer.put(0, 1, "k_0_0", {"v": torch.ones(2)}).ok  # republished: reported again
        assert consumer.wait_any(["k_0_0"], timeout=10) == ["k_0_0"]
        assert consumer.get(0, 1, "k_0_0") is not None
    finally:
        rival.close()


def test_without_inotify_falls_back_to_polling(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_inotify(self: Any, directory: str) -> None:
        raise OSError(errno.EMFILE, "too many inotify instances")

    monkeypatch.setattr(notify._Watch, "__init__", no_inotify)
    with create_connector("shm", {"namespace": namespace}) as producer, create_connector("shm", {"namespace": namespace}) as consumer:
        assert consumer.wait_any(["a_0_0"], timeout=0.02) == []
        timer = threading.Timer(0.1, lambda: producer.put(0, 1, "a_0_0", {"v": torch.ones(2)}))
        timer.start()
        try:
            assert consumer.wait_any(["a_0_0", "b_0_0"], timeout=10) == ["a_0_0"]
        finally:
            timer.join()
        assert consumer.get(0, 1, "a_0_0") is not None


def _waiter(conn: Any, keys: list[str], timeout: float) -> tuple[threading.Thread, list[list[str]]]:
    out: list[list[str]] = []
    thread = threading.Thread(target=lambda: out.append(conn.wait_any(keys, timeout)))
    thread.start()
    return thread, out


def test_interrupt_wait_ends_a_blocked_wait_at_once_and_only_this_instances(namespace: str) -> None:
    with create_connector("shm", {"namespace": namespace}) as a, create_connector("shm", {"namespace": namespace}) as b:
        assert a.capabilities.interrupt_wait is True
        mine, got_mine = _waiter(a, ["nothing"], 60)
        other, got_other = _waiter(b, ["other"], 60)
        mine.join(0.2)
        assert mine.is_alive()
        a.interrupt_wait()
        mine.join(JOIN)  # far below the 60 s bound: the interrupt ended it
        assert not mine.is_alive() and got_mine == [[]]
        other.join(0.3)
        assert other.is_alive()  # b's wait woke for nothing and sleeps on
        a.put(0, 1, "other", make_payload(1, 1000))
        other.join(JOIN)
        assert got_other == [["other"]]
        assert b.cleanup("other")


def test_interrupt_before_a_wait_ends_the_next_one_only_and_never_raises(namespace: str) -> None:
    conn = create_connector("shm", {"namespace": namespace})
    conn.interrupt_wait()
    conn.interrupt_wait()  # not counted: one pending interrupt
    assert conn.wait_any(["x"], 60) == []
    assert conn.wait_any(["x"], 0.05) == []  # runs out its bound
    conn.put(0, 1, "y", make_payload(2, 1000))
    conn.interrupt_wait()
    assert conn.wait_any(["y"], 60) == ["y"]  # found keys win; the interrupt is used up
    assert conn.wait_any(["x"], 0.05) == []
    assert conn.cleanup("y")
    conn.close()
    conn.interrupt_wait()  # after close: nothing, no error


def test_interrupt_wait_capability_is_off_without_the_slot_table(file_pair: Any) -> None:
    _producer, consumer = file_pair
    assert consumer.capabilities.interrupt_wait is False
    consumer.interrupt_wait()  # does nothing, never raises
