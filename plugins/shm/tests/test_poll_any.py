"""``ShmConnector.poll_any``: ``wait_any`` that busy-polls the wake word (real /dev/shm).

Arrivals from another process: ``test_wait_any.py::test_keys_put_by_another_process[poll_any]``.
"""

from __future__ import annotations

import mmap
import threading
import time
from typing import Any

import pytest
from omni_plugins_shm import _native
from omni_plugins_shm.connector import SPIN_MAX_S
from omni_plugins_shm.testing import make_payload

from omni_plugins import create_connector

JOIN = 120


def test_capability_is_on_with_the_slot_table(pair: Any) -> None:
    assert pair[1].capabilities.poll_any is True


def test_capability_is_off_without_the_slot_table(file_pair: Any) -> None:
    assert file_pair[1].capabilities.poll_any is False


def test_a_long_timeout_is_cut_to_the_spin_bound(pair: Any) -> None:
    _producer, consumer = pair
    t0 = time.monotonic()
    assert consumer.poll_any(["absent_0_0"], timeout=60) == []
    assert time.monotonic() - t0 < 60  # returned by itself (SPIN_MAX_S), long before the 60 s asked for
    assert SPIN_MAX_S <= 0.1


def test_the_gil_is_let_go_while_polling(pair: Any) -> None:
    _producer, consumer = pair
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    th = threading.Thread(target=count)
    th.start()
    try:
        time.sleep(0.01)
        before = counted[0]
        consumer.poll_any(["absent_0_0"], timeout=SPIN_MAX_S)  # one C spin of SPIN_MAX_S with the GIL released
        during = counted[0] - before
    finally:
        stop.set()
        th.join(JOIN)
    assert during > 0


def test_interrupt_wait_ends_a_poll(namespace: str) -> None:
    with create_connector("shm", {"namespace": namespace}) as conn:
        conn.interrupt_wait()  # pending: the next poll returns at its first look
        assert conn.poll_any(["x_0_0"], timeout=SPIN_MAX_S) == []
        conn.put(0, 1, "y_0_0", make_payload(1, 100))
        assert conn.poll_any(["x_0_0", "y_0_0"], timeout=SPIN_MAX_S) == ["y_0_0"]
        assert conn.cleanup("y_0_0")


def test_without_the_slot_table_poll_any_is_wait_any(file_pair: Any) -> None:
    producer, consumer = file_pair
    assert producer.put(0, 1, "f_0_0", make_payload(2, 100)).ok
    assert consumer.poll_any(["f_0_0", "g_0_0"], timeout=10) == ["f_0_0"]
    assert consumer.get(0, 1, "f_0_0") is not None


def test_native_spin_sees_a_change_and_checks_its_arguments() -> None:
    mm = mmap.mmap(-1, 4096)
    assert _native.spin(mm, 64, 0, 0.001) is False  # nothing changed: ran out its time
    mm[64] = 1
    assert _native.spin(mm, 64, 0, 1.0) is True  # already different: returns at the first look
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="seconds"):
            _native.spin(mm, 64, 0, bad)
    with pytest.raises(ValueError, match="offset"):
        _native.spin(mm, 4094, 0, 0.0)
