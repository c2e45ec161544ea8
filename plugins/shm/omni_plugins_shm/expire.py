"""Expiry of published payloads nobody claimed: ``ttl_seconds`` (producer) and ``gc --ttl`` (anyone).

A payload whose consumer died stays published -- holding its segment -- until its
producer closes. With a TTL the producer reclaims its own unclaimed payloads
older than the TTL: :class:`Expiry` keeps one record per publication in publish
order and, at most every ``ttl / 8`` seconds (checked on ``put``; an idle
producer reclaims on its next put or close), looks at the oldest records only.
A record whose pooled segment came back (FREE) or was reused since is dropped
without a syscall; an expired one is claimed like a ``get`` would (a rename, so
a consumer racing for it either wins it whole or finds nothing) and freed.

:func:`collect_expired` does the same for every owner from outside (``omni-plugins
shm gc --ttl S``), judging age by the published file's ``ctime`` (the publishing
rename sets it; writes into a mapped tmpfs page after the first do not).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from omni_plugins_shm import slots
from omni_plugins_shm.gc import DEFAULT_SHM_DIR, GcReport, read_header
from omni_plugins_shm.naming import HASHED, PREFIX, PUBLISH_DIR, PUBLISHED, Names, namespace_prefix, parse_name, publish_dir_name
from omni_plugins_shm.proc import Owner
from omni_plugins_shm.segments import shared
from omni_plugins_shm.segments.files import rename_noreplace, unlink_quiet
from omni_plugins_shm.segments.header import CLOSED_OFFSET, STATE_FREE, STATE_OFFSET
from omni_plugins_shm.segments.pool import Segment

log = logging.getLogger(__name__)

#: records kept before the already-consumed ones are compacted away (and, failing that, the oldest forgotten)
MAX_RECORDS = 1 << 16


def free_claimed(directory: str, names: Names, claim: str) -> bool:
    """Free a segment we claimed without reading it: return pooled ones to their owner, unlink the rest.

    True when its header says it was counted in the slot table's file-path hint (the caller lowers it).
    A process out of descriptors cannot read the header: the segment is unlinked all the same (the
    owner's pool then misses it, and a counted one leaves the hint too high: both harmless).
    """
    try:
        header = read_header(claim)
    except OSError:
        header = None
    counted = header is not None and header.counted
    if header is None or not header.pooled:
        unlink_quiet(claim)
        return counted
    if header.shared and not shared.leave(claim):  # other keys of a fan-out still hold it
        return counted
    free = f"{directory}/{names.free(header.owner.token, header.seg_no)}"
    try:
        fd = os.open(claim, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return counted
    try:
        os.rename(claim, free)
        os.pwrite(fd, bytes([STATE_FREE]), STATE_OFFSET)
        if os.pread(fd, 1, CLOSED_OFFSET) != b"\0":
            unlink_quiet(free)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
    return counted


def reclaim(directory: str, names: Names, published: str, claim: str, is_ours: Callable[[Owner, int], bool]) -> tuple[bool, bool]:
    """Claim ``published`` to ``claim`` and free it if ``is_ours(owner, seg_no)`` says it is the expired payload.

    Anything else found there (a newer put of the key) is put back, unless an even newer put took
    the name meanwhile (then ours is the older one and is freed: a newer put replaces an older).
    Returns ``(freed, counted)``: whether a payload was freed, and whether it was counted in the slot
    table's file-path hint (the caller lowers the hint).
    """
    try:
        os.rename(published, claim)
    except FileNotFoundError:
        return False, False
    try:
        header = read_header(claim)
    except OSError:  # cannot tell whose it is (out of descriptors): put it back and let the caller say so
        try:
            rename_noreplace(claim, published)
        except FileExistsError:
            return True, free_claimed(directory, names, claim)  # a newer put replaced it: ours was the older one
        raise
    if header is not None and not is_ours(header.owner, header.seg_no):
        try:
            rename_noreplace(claim, published)
            return False, False
        except FileExistsError:
            pass
        except FileNotFoundError:
            return False, False
    return True, free_claimed(directory, names, claim)


@dataclass(slots=True)
class Publication:
    """One payload a producer published: where, when, and in which segment (use) it lives."""

    at: float
    path: str
    seg_no: int
    #: the pooled segment (None for a dedicated one: its number is never reused)
    seg: Segment | None
    #: ``seg.uses`` at publication: a different count means the segment came back and was reused
    use: int

    def settled(self) -> bool:
        """Known consumed (or freed) without a syscall: only pooled segments can tell."""
        seg = self.seg
        return seg is not None and (seg.uses != self.use or seg.looks_free())


class Expiry:
    """A producer's publications, oldest first; :meth:`expire` reclaims those older than ``ttl``."""

    def __init__(self, ttl: float, reclaim_one: Callable[[Publication], bool]) -> None:
        self.ttl = ttl
        self._reclaim = reclaim_one
        self._records: deque[Publication] = deque()
        self._lock = threading.Lock()
        self._every = ttl / 8
        self._next = time.monotonic() + self._every
        self._warned = False
        #: payloads this producer reclaimed (health / tests)
        self.expired = 0

    def published(self, path: str, seg: Segment) -> None:
        rec = Publication(time.monotonic(), path, seg.no, seg if seg.pooled else None, seg.uses)
        with self._lock:
            records = self._records
            records.append(rec)
            if len(records) > MAX_RECORDS:
                self._compact()

    def _compact(self) -> None:
        kept = deque(r for r in self._records if not r.settled())
        while len(kept) > MAX_RECORDS // 2:
            kept.popleft()
            if not self._warned:
                self._warned = True
                log.warning("shm ttl: more than %d unclaimed payloads; the oldest are left to close / gc --ttl", MAX_RECORDS // 2)
        self._records = kept

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def expire(self) -> int:
        """Reclaim the expired publications (oldest first); the number freed."""
        now = time.monotonic()
        self._next = now + self._every
        limit = now - self.ttl
        expired: list[Publication] = []
        with self._lock:
            records = self._records
            while records and records[0].at <= limit:
                rec = records.popleft()
                if not rec.settled():
                    expired.append(rec)
        freed = sum(1 for rec in expired if self._reclaim(rec))
        self.expired += freed
        if freed:
            log.info("shm ttl: reclaimed %d payloads unclaimed for %.1f s", freed, self.ttl)
        return freed


def collect_expired(namespace: str | None, ttl: float, *, shm_dir: str = DEFAULT_SHM_DIR, dry_run: bool = False) -> GcReport:
    """Free published payloads of any (live) owner older than ``ttl`` seconds (by ``ctime``).

    Pooled segments go back to their owner (renamed ``f.``, marked FREE), dedicated ones are
    unlinked. Payloads of dead owners are plain :func:`omni_plugins_shm.gc.collect` garbage.
    """
    report = GcReport()
    prefix = namespace_prefix(namespace) if namespace is not None else f"{PREFIX}."
    try:
        with os.scandir(shm_dir) as it:
            dirs = [e.name for e in it if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return report
    me = Owner.new().token
    numbers = itertools.count()
    for d in dirs:
        ns = d[len(PREFIX) + 1 : -len(PUBLISH_DIR) - 1]
        if not ns or publish_dir_name(ns) != d:
            continue
        names = Names(ns)
        pub = os.path.join(shm_dir, d)
        table = os.path.join(pub, names.slots())
        freed = slots.expire(table, ttl, time.time(), dry_run)
        counted = 0
        report.removed += [f"{names.slots()}[slot]"] * freed
        try:
            with os.scandir(pub) as it:
                found = [e.name for e in it if e.name.startswith(names.prefix)]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in found:
            parsed = parse_name(name)
            if parsed is None or parsed.kind not in (PUBLISHED, HASHED):
                continue
            path = os.path.join(pub, name)
            try:
                st = os.lstat(path)  # just before the claim: a newer put of the key is not judged by an old stat
            except FileNotFoundError:
                continue
            if st.st_ctime > time.time() - ttl:
                report.kept.append(name)
                continue
            if not dry_run:
                claim = f"{shm_dir}/{names.claimed(me, next(numbers))}"
                try:
                    done, was_counted = reclaim(shm_dir, names, path, claim, lambda owner, no: True)
                except OSError as exc:
                    report.errors.append(f"{name}: {exc}")
                    continue
                if not done:
                    continue
                counted += was_counted
            report.removed.append(name)
            report.bytes_freed += st.st_blocks * 512
        slots.lower_files_hint(table, counted)
    return report
