"""The hand-off floor: the connector alone plus one thread hand-off per chunk on each side, and nothing else.

A runtime keeps I/O off the model thread: the producer's model thread hands each chunk to a send
thread, and a receive thread hands each arrival to the consumer's model thread. In CPython those
threads share the GIL, so every hand-off costs whatever the two threads pay to take turns with it
(futex waits and wake-ups, context switches), besides the queue itself. The load section's
``floor`` mode measures exactly that: the ``connector`` mode's puts and gets, each crossing to
another thread through a :class:`queue.SimpleQueue` (a C queue: one lock per put and get), with no
runtime bookkeeping, no payload snapshot and no batching policy. What it cannot deliver, no runtime
of that shape can: where it misses a target, the target is out of reach here and its figure is
the proof.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


class SendThread:
    """Calls ``send(*args)`` on a thread of its own for each :meth:`submit` ``(*args)``, in order."""

    def __init__(self, send: Callable[..., Any], name: str = "floor-send") -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._send = send
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, *args: Any) -> None:
        self._queue.put(args)

    def close(self) -> None:
        """Wait until every submitted call was made (idempotent); re-raises what one raised."""
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        get, send = self._queue.get, self._send
        while (args := get()) is not _DONE:
            if self._error is None:
                try:
                    send(*args)
                except BaseException as exc:  # reported by close(); the rest is drained unsent
                    self._error = exc


def on_own_thread(items: Iterable[T], name: str = "floor-recv") -> Iterator[T]:
    """``items`` produced on a thread of their own, each handed to the caller's thread as it comes.

    Re-raises on the caller's thread what producing them raised.
    """
    handed: queue.SimpleQueue[Any] = queue.SimpleQueue()
    error: list[BaseException] = []

    def run() -> None:
        try:
            for item in items:
                handed.put(item)
        except BaseException as exc:
            error.append(exc)
        finally:
            handed.put(_DONE)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    get = handed.get
    while (item := get()) is not _DONE:
        yield item
    thread.join()
    if error:
        raise error[0]
