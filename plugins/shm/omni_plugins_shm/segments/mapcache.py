"""The consumer's cache of mappings of pooled segments.

A pooled segment comes back to the same consumer again and again; mapping it
once and keeping the mapping saves the open/mmap/munmap and the page-table
faults (re-mapping a 64 MiB segment halves the copy-out speed). Entries are
keyed by ``(st_dev, st_ino)``: one ``stat`` of the claimed name finds the
mapping. An inode number cannot be reused while we hold the file open and
mapped, and the header read from the mapping must still name the claimed key.

A cached mapping pins its tmpfs pages even after the producer unlinks the file,
so each entry keeps its fd and entries whose file is gone (``st_nlink == 0``)
are dropped by a sweep that runs on a cache miss at most once per second
(a sweep costs one ``fstat`` per entry) and by :meth:`MapCache.sweep`.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from omni_plugins_shm.proc import Owner
from omni_plugins_shm.segments.files import close_quiet, map_segment
from omni_plugins_shm.segments.header import Header

log = logging.getLogger(__name__)

_SWEEP_INTERVAL = 1.0


@dataclass(eq=False)
class Mapping:
    """A consumer-side mapping of one segment; ``leases`` counts zero-copy results still alive."""

    mm: mmap.mmap
    capacity: int
    fd: int = -1
    leases: int = 0
    cached: bool = False
    #: ``(owner token, segment number)`` and the ``f.`` path a consumer returns this segment to
    #: (fixed for a pooled segment's life; cached because it is built on every return)
    free_for: tuple[Owner, int] | None = None
    free_path: str | None = None  #: where the segment goes back to its owner; None: unlink it (owner not open)
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = memoryview(self.mm)

    def drop(self) -> None:
        """Forget the mapping: close fd; unmap now, or when the last zero-copy view dies."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.leases == 0:
            try:
                self.view.release()
            except BufferError:
                pass
            close_quiet(self.mm)


class MapCache:
    """LRU of mappings of pooled segments, bounded by mapped bytes."""

    def __init__(self, budget_bytes: int) -> None:
        self._budget = budget_bytes
        self._entries: OrderedDict[tuple[int, int], Mapping] = OrderedDict()
        self._bytes = 0
        self._last_sweep = 0.0
        # re-entrant: weakref finalizers of zero-copy/owned results take this lock and can run
        # in the middle of any allocation, including one made while this thread holds it
        self._lock = threading.RLock()

    def lookup(self, ident: tuple[int, int]) -> Mapping | None:
        """The cached mapping of the file with ``(st_dev, st_ino)``, if any."""
        with self._lock:
            hit = self._entries.get(ident)
            if hit is not None:
                self._entries.move_to_end(ident)
            return hit

    def map(self, ident: tuple[int, int], fd: int, header: Header) -> tuple[Mapping, bool]:
        """Map the segment open at ``fd``; cache pooled ones. Returns ``(mapping, fd_kept)``.

        The caller closes ``fd`` unless it was kept by the new cache entry.
        """
        if not header.pooled or header.capacity > self._budget:
            return Mapping(map_segment(fd, header.capacity), header.capacity), False
        mapping = Mapping(map_segment(fd, header.capacity), header.capacity, fd=fd, cached=True)
        with self._lock:
            now = time.monotonic()
            if now - self._last_sweep >= _SWEEP_INTERVAL:
                self._last_sweep = now
                self._sweep_locked()
            old = self._entries.get(ident)
            if old is not None and old.capacity == mapping.capacity:
                # another thread mapped the same file meanwhile (a segment published under several keys, read
                # by two threads): it may be reading through that mapping now, so keep it and drop ours
                self._entries.move_to_end(ident)
                mapping.fd = -1  # the caller closes fd
                mapping.cached = False
                mapping.drop()
                return old, False
            if old is not None:
                self._remove_locked(ident, old)
            self._entries[ident] = mapping
            self._bytes += mapping.capacity
            self._evict_locked()
        return mapping, True

    def _evict_locked(self) -> None:
        while self._bytes > self._budget and self._entries:
            ident, victim = next(iter(self._entries.items()))
            self._remove_locked(ident, victim)

    def _remove_locked(self, ident: tuple[int, int], victim: Mapping) -> None:
        del self._entries[ident]
        self._bytes -= victim.capacity
        victim.cached = False
        victim.drop()

    def _sweep_locked(self) -> None:
        for ident, m in list(self._entries.items()):
            try:
                gone = os.fstat(m.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                self._remove_locked(ident, m)

    def lease(self, mapping: Mapping) -> None:
        """Count one more zero-copy result over ``mapping`` (keeps it mapped past eviction)."""
        with self._lock:
            mapping.leases += 1

    def unlease(self, mapping: Mapping) -> None:
        """The last view of one zero-copy result died; unmap if the cache no longer holds the mapping."""
        with self._lock:
            mapping.leases -= 1
            if mapping.leases == 0 and not mapping.cached:
                mapping.drop()

    def clear(self) -> None:
        with self._lock:
            for ident, m in list(self._entries.items()):
                self._remove_locked(ident, m)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"cached_mappings": len(self._entries), "cached_bytes": self._bytes}
