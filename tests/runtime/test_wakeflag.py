"""WakeFlag: the model thread's wake-up flag behaves like threading.Event for set/clear/wait."""

from __future__ import annotations

import threading

from omni_plugins.runtime.wakeflag import WakeFlag


def test_set_clear_and_wait_without_blocking() -> None:
    flag = WakeFlag()
    assert not flag.is_set()
    assert flag.wait(0) is False
    assert flag.wait(0.01) is False
    flag.set()
    flag.set()  # idempotent
    assert flag.is_set() and flag.wait(0) and flag.wait(None)
    flag.clear()
    flag.clear()  # idempotent
    assert not flag.is_set() and flag.wait(0) is False
    flag.set()
    assert flag.wait(0.01)


def test_set_wakes_every_blocked_waiter_and_they_leave_it_set() -> None:
    flag = WakeFlag()
    woke: list[bool] = []
    started = threading.Barrier(4)

    def waiter() -> None:
        started.wait()
        woke.append(flag.wait(30))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    flag.set()
    for t in threads:
        t.join(30)
    assert woke == [True, True, True]
    assert flag.is_set()
    flag.clear()  # a clear after the waiters passed does not block
    assert not flag.is_set()
