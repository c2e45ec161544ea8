"""Cleanup that rides along with the next write to a server: no round trip, no system call of its own.

Deleting a commit marker or a claim list costs nothing extra this way: the
command is framed once, waits in the server's :class:`NodeQueue`, and is
sent in front of the next command to that server; its reply is read with
that command's replies. A consumed payload's parts are *retired* rather than
deleted, for the next parted put to reuse their memory (see
``RedisConnector._write_parts``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

from omni_plugins_redis.packing import Arg, pack_many


class Deferred(NamedTuple):
    """An idempotent cleanup command waiting for the next write to its server."""

    slot: int
    args: tuple[Arg, ...]
    frame: bytes


class NodeQueue:
    """Cleanup waiting for the next write to one server: deferred commands and consumed payloads' parts.

    Parts are *retired* rather than deleted: the next parted put to this server
    deletes them one right before each of its own parts, so the server stores
    the new part in the memory the old one just left instead of faulting in
    fresh pages (see ``RedisConnector._write_parts``). Any other write deletes
    them at once.
    """

    __slots__ = ("_lock", "deferred", "retired")

    def __init__(self) -> None:
        self.deferred: list[Deferred] = []
        self.retired: list[tuple[int, list[bytes]]] = []  # (slot, parts of one payload)
        self._lock = threading.Lock()

    @property
    def pending(self) -> bool:
        return bool(self.deferred or self.retired)

    def add(self, items: Sequence[Deferred]) -> None:
        with self._lock:
            self.deferred.extend(items)

    def retire(self, slot: int, keys: Sequence[bytes]) -> None:
        with self._lock:
            self.retired.append((slot, list(keys)))

    def take_retired(self) -> list[tuple[int, list[bytes]]]:
        with self._lock:
            groups, self.retired = self.retired, []
        return groups

    def take_all(self) -> list[Deferred]:
        """Everything waiting, retired parts as one ``UNLINK`` per payload (one hash tag each), now the caller's to send."""
        with self._lock:
            items, self.deferred = self.deferred, []
            groups, self.retired = self.retired, []
        for slot, keys in groups:
            args: tuple[Arg, ...] = ("UNLINK", *keys)
            items.append(Deferred(slot, args, b"".join(pack_many([args]))))
        return items
