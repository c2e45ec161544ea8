"""One-way message channels between a host's run process and its stage processes, over pipes.

``multiprocessing.Queue`` holds three named POSIX semaphores (``/dev/shm/sem.mp-*``) under the
fork-server and spawn start methods; the process that made them, or its resource tracker, unlinks
them. A host whose whole process group is killed takes both along and leaves the semaphores in
``/dev/shm`` for good. A pipe is two file descriptors, which the kernel frees with the last
process that holds one: nothing of a killed run stays behind.

- :class:`Outbox`, the writing end: ``put`` hands the message to a feeder thread and returns, so a
  busy or stuck reader never holds up the writer (as with ``multiprocessing.Queue``); ``close``
  sends what is still queued, for a bounded time.
- :class:`Inbox`, the reading end: ``get(timeout)`` and ``get_nowait`` raise ``queue.Empty`` as
  ``queue.Queue``'s do, also once the writer is gone.
- :func:`read_any`: the messages waiting on any of several inboxes (one per stage process).

Both ends are passed to a stage process as ``Process`` arguments (the pipe's descriptor goes
along); a message is any picklable object of the orchestrator's own (never a payload).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

#: how long ``Outbox.close`` waits for its feeder to send what is queued
FLUSH_TIMEOUT_S = 5.0


class Outbox:
    """The writing end of a pipe: ``put`` never blocks; a feeder thread sends in order."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queued: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._feeder: threading.Thread | None = None
        self._closed = False
        self._broken = False

    def __reduce__(self) -> tuple[Callable[[Connection], Outbox], tuple[Connection]]:
        return Outbox, (self._conn,)

    def put(self, message: Any) -> None:
        """Queue ``message`` for the reader (dropped once the reader is gone: its death is noticed elsewhere)."""
        with self._cond:
            if self._closed or self._broken:
                return
            self._queued.append(message)
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="omni-outbox", daemon=True)
                self._feeder.start()
            self._cond.notify()

    def _feed(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if not self._queued:
                    return
                message = self._queued.popleft()
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the reader closed its end or died
                with self._cond:
                    self._broken = True
                    self._queued.clear()
                return

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """Send what is queued (up to ``timeout`` s), then close the pipe's end."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            feeder = self._feeder
        if feeder is not None:
            feeder.join(timeout)
        if feeder is None or not feeder.is_alive():
            self._conn.close()


class Inbox:
    """The reading end of a pipe, read like a ``queue.Queue``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        #: the writer closed its end or died: nothing more will come
        self.ended = False

    def __reduce__(self) -> tuple[Callable[[Connection], Inbox], tuple[Connection]]:
        return Inbox, (self.conn,)

    def get(self, timeout: float | None = None) -> Any:
        """The next message, waiting up to ``timeout`` s (``None``: for ever); ``queue.Empty`` when none came."""
        if self.ended or not self.conn.poll(timeout):
            raise queue.Empty
        return self.recv()

    def get_nowait(self) -> Any:
        return self.get(0)

    def recv(self) -> Any:
        """The next message, which must be there (``conn.poll()`` said so); ``queue.Empty`` at the end of the pipe."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.ended = True
            raise queue.Empty from None

    def close(self) -> None:
        self.conn.close()


def read_any(inboxes: Iterable[Inbox], timeout: float) -> list[Any]:
    """Every message waiting on ``inboxes``, after waiting up to ``timeout`` s for the first."""
    by_conn = {inbox.conn: inbox for inbox in inboxes if not inbox.ended}
    messages: list[Any] = []
    ready = wait(list(by_conn), timeout) if by_conn else []
    while ready:
        for conn in ready:
            inbox = by_conn[conn]  # type: ignore[index]
            try:
                messages.append(inbox.recv())
            except queue.Empty:
                del by_conn[conn]  # type: ignore[arg-type]
        ready = wait(list(by_conn), 0) if by_conn else []
    return messages
