"""The consumer's cache of mappings of pooled segments.

A pooled segment comes back to the same consumer again and again; mapping it
once and keeping the mapping saves the open/mmap/munmap and the page-table
faults (re-mapping a 64 MiB segment halves the copy-out speed). Entries are
keyed by ``(st_dev, st_ino)``: one ``stat`` of the claimed name finds the
mapping. An inode number cannot be reused while we hold the file mapped, and
the header read from the mapping must still name the claimed key.

An entry holds no file descriptor (see :mod:`omni_plugins_shm.segments.files`;
where a mapping cannot help holding one, the cache keeps at most a quarter of
the process's ``RLIMIT_NOFILE`` soft limit in entries, so it cannot starve the
application's own opens). A cached mapping pins its tmpfs pages only once its
owner let go of them too -- the owner keeps every pooled segment mapped while it
lives -- so entries whose owner closed (the CLOSED byte it sets in every
segment's header on close) or died are dropped by a sweep that runs on a cache
miss at most once per second (one header byte per entry, one ``/proc`` read per
owner). :meth:`MapCache.shed` gives up every idle entry at once: a get that ran
short of descriptors or mappings tries again with what the cache held.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from omni_plugins_shm import shortage
from omni_plugins_shm.proc import Owner
from omni_plugins_shm.segments.files import MAPPING_HOLDS_FD, MappedFile, close_quiet, map_file
from omni_plugins_shm.segments.header import CLOSED_OFFSET, Header

log = logging.getLogger(__name__)

_SWEEP_INTERVAL = 1.0


def descriptor_cap() -> int | None:
    """Most entries a cache should keep: a quarter of the soft ``RLIMIT_NOFILE`` where a mapping holds a descriptor, else no cap."""
    if not MAPPING_HOLDS_FD:
        return None
    soft, _ = shortage.descriptor_limits()
    return None if soft == resource.RLIM_INFINITY else soft // 4


@dataclass(eq=False)
class Mapping:
    """A consumer-side mapping of one segment; ``leases`` counts zero-copy results still alive."""

    mm: MappedFile
    capacity: int
    #: the segment's owner (from its header): the sweep drops the mapping once the owner closed or died
    owner: Owner
    leases: int = 0
    cached: bool = False
    #: ``(owner token, segment number)`` and the ``f.`` path a consumer returns this segment to
    #: (fixed for a pooled segment's life; cached because it is built on every return)
    free_for: tuple[Owner, int] | None = None
    free_path: str | None = None  #: where the segment goes back to its owner; None: unlink it (owner not open)
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = memoryview(self.mm)

    def drop(self) -> bool:
        """Forget the mapping: unmap now (True), or when the last zero-copy view dies."""
        if self.leases == 0:
            try:
                self.view.release()
            except BufferError:
                pass
            close_quiet(self.mm)
            return True
        return False


class MapCache:
    """LRU of mappings of pooled segments, bounded by mapped bytes (and by ``max_entries`` if given)."""

    def __init__(self, budget_bytes: int, max_entries: int | None = None) -> None:
        self._budget = budget_bytes
        self._max_entries = max_entries
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

    def map(self, ident: tuple[int, int], fd: int, header: Header) -> Mapping:
        """Map the segment open at ``fd`` (the caller closes it afterwards); cache pooled ones."""
        if not header.pooled or header.capacity > self._budget or self._max_entries == 0:
            return Mapping(map_file(fd, header.capacity), header.capacity, header.owner)
        mapping = Mapping(map_file(fd, header.capacity), header.capacity, header.owner, cached=True)
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
                mapping.cached = False
                mapping.drop()
                return old
            if old is not None:
                self._remove_locked(ident, old)
            self._entries[ident] = mapping
            self._bytes += mapping.capacity
            self._evict_locked()
        return mapping

    def _evict_locked(self) -> None:
        entries, most = self._entries, self._max_entries
        while entries and (self._bytes > self._budget or (most is not None and len(entries) > most)):
            ident, victim = next(iter(entries.items()))
            self._remove_locked(ident, victim)

    def _remove_locked(self, ident: tuple[int, int], victim: Mapping) -> bool:
        del self._entries[ident]
        self._bytes -= victim.capacity
        victim.cached = False
        return victim.drop()

    def _sweep_locked(self) -> None:
        alive: dict[Owner, bool] = {}
        for ident, m in list(self._entries.items()):
            gone = m.view[CLOSED_OFFSET] != 0
            if not gone:
                owner = m.owner
                if owner not in alive:
                    try:
                        alive[owner] = owner.process_alive()
                    except OSError:  # cannot tell (no descriptor to read /proc with): keep it
                        alive[owner] = True
                gone = not alive[owner]
            if gone:
                self._remove_locked(ident, m)

    def shed(self) -> int:
        """Drop every entry; how many mappings that unmapped (entries lent out go when their last view dies)."""
        with self._lock:
            return sum(self._remove_locked(ident, m) for ident, m in list(self._entries.items()))

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
