"""The hand-off floor's threads: every item crosses, in order, on another thread; errors reach the caller."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from omni_plugins.bench.handoff import SendThread, on_own_thread


def test_a_send_thread_makes_every_call_in_order_on_its_own_thread() -> None:
    calls: list[tuple[int, str]] = []
    threads: set[int] = set()

    def send(i: int, tag: str) -> None:
        threads.add(threading.get_ident())
        calls.append((i, tag))

    sender = SendThread(send)
    for i in range(500):
        sender.submit(i, "x")
    sender.close()
    sender.close()  # idempotent
    assert calls == [(i, "x") for i in range(500)]
    assert threads and threading.get_ident() not in threads


def test_a_failed_send_is_raised_by_close() -> None:
    def send(i: int) -> None:
        if i == 3:
            raise OSError("backend gone")

    sender = SendThread(send)
    for i in range(10):
        sender.submit(i)
    with pytest.raises(OSError, match="backend gone"):
        sender.close()


def test_items_made_on_their_own_thread_reach_the_caller_in_order() -> None:
    made_on: set[int] = set()

    def items() -> Iterator[int]:
        for i in range(300):
            made_on.add(threading.get_ident())
            yield i

    assert list(on_own_thread(items())) == list(range(300))
    assert made_on and threading.get_ident() not in made_on


def test_what_making_the_items_raised_reaches_the_caller_after_what_was_made() -> None:
    def items() -> Iterator[int]:
        yield 1
        raise ValueError("torn payload")

    got: list[int] = []
    with pytest.raises(ValueError, match="torn payload"):
        for i in on_own_thread(items()):
            got.append(i)
    assert got == [1]
