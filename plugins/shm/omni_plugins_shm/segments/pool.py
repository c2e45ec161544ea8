"""The producer's pool of pre-faulted segments, reused instead of creating one per payload.

A fresh tmpfs segment costs a page fault per 4 KiB page (about 0.6-0.8 GB/s);
a segment whose pages are already allocated and mapped is written at memcpy
speed. So a producer keeps its segments, grouped in size classes, and the
consumer hands each one back by renaming it to its ``f.`` (free) name after it
has copied the payload out (or after its last zero-copy view died) and then
setting the FREE byte in the header. FREE therefore means "named ``f.``, nobody
reads it": the owner writes the next payload into it without any syscall and
publishes it with one rename ``f. -> k.<key>`` (syscalls cost 5-12 us here).

Payloads larger than ``max_segment`` (or beyond the ``pool_bytes`` budget) get a
dedicated segment that the consumer unlinks.

Finding a free segment is O(1) amortised (see :class:`SizeClass`): the owner learns of returns
by probing at most ``PROBES`` of its oldest outstanding segments per ``acquire``, never by
scanning all of them or listing the directory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from omni_plugins_shm.naming import Names
from omni_plugins_shm.segments import shared
from omni_plugins_shm.segments.files import PAGE, MappedFile, close_quiet, create_segment, rename_noreplace, round_up, unlink_quiet
from omni_plugins_shm.segments.header import CLOSED_OFFSET, PAYLOAD_OFFSET, STATE_BUSY, STATE_FREE, STATE_OFFSET

log = logging.getLogger(__name__)

MIN_CLASS = 16 << 10
#: oldest outstanding segments of a size class probed (one header byte each) per acquire, at most
PROBES = 4
#: a segment still busy this many publications (of its class) after its own is probed rarely
LAG = 256


def size_class(total: int) -> int:
    """Capacity for a segment holding ``total`` bytes: 16 KiB, then quarter steps between powers of two."""
    if total <= MIN_CLASS:
        return MIN_CLASS
    top = 1 << (total - 1).bit_length()
    step = top // 8  # classes: top/2 * {1, 1.25, 1.5, 1.75, 2}
    return round_up(max(round_up(total, step), PAGE))


@dataclass(eq=False)
class Segment:
    """One segment the producer holds mapped (pooled) or is about to hand off (dedicated)."""

    no: int
    capacity: int
    mm: MappedFile
    pooled: bool
    #: path of the segment while we hold it: its ``w.`` name when new, its ``f.`` name when reused
    path: str = ""
    #: its ``f.`` path (where consumers return it), built once
    free: str = ""
    #: publications so far (a record of one tells whether the segment was reused since)
    uses: int = 0
    #: its class's publication count when it was last published (its age in publications)
    seq: int = 0
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = memoryview(self.mm)

    def looks_free(self) -> bool:
        return self.view[STATE_OFFSET] == STATE_FREE

    def mark_busy(self) -> None:
        self.view[STATE_OFFSET] = STATE_BUSY

    def release_memory(self) -> None:
        try:
            self.view.release()
        except BufferError:
            pass
        close_quiet(self.mm)


class SizeClass:
    """The pooled segments of one capacity: known-free ones and outstanding ones, oldest first.

    ``ready``: segments known to be FREE (abandoned, or seen FREE by a probe); only the owner
    makes a segment busy, so they stay free. ``out``: published segments in publish order.
    ``slow``: segments still busy ``LAG`` publications after their own (a consumer lags far
    behind, or never comes), rotated. Consumers take payloads roughly in the order they were
    put, so an acquire with nothing ready probes the newest segment (a put/get ping-pong
    returns it before the next put), then the oldest of ``out`` -- taking it if FREE, moving
    it to ``slow`` if it is older than ``LAG``, and stopping at the first young busy one
    (younger ones are unlikely back) -- up to ``PROBES`` times, then one of ``slow``.

    At most ``PROBES + 2`` header bytes per acquire however many payloads are unclaimed; a
    long-unclaimed one costs one probe per ``len(slow)`` acquires. The price: a segment
    returned far out of order is found later, and meanwhile the class may grow by new
    segments (within ``pool_bytes``; beyond it payloads get dedicated segments as before).
    """

    __slots__ = ("out", "published", "ready", "segments", "slow")

    def __init__(self) -> None:
        self.ready: deque[Segment] = deque()
        self.out: deque[Segment] = deque()
        self.slow: deque[Segment] = deque()
        #: every pooled segment of this class (for close / forget)
        self.segments: list[Segment] = []
        #: publications of this class so far (``Segment.seq`` is its value at the segment's publication)
        self.published = 0

    def publish(self, seg: Segment) -> None:
        self.published += 1
        seg.seq = self.published
        self.out.append(seg)

    def take(self) -> Segment | None:
        """A free segment (marked busy), or None if none is known free after a bounded probe."""
        ready = self.ready
        if not ready:
            self._probe()
            if not ready:
                return None
        seg = ready.popleft()
        seg.mark_busy()
        seg.path = seg.free
        return seg

    def _probe(self) -> None:
        ready, out, slow = self.ready, self.out, self.slow
        if out and out[-1].looks_free():
            ready.append(out.pop())
        old = self.published - LAG
        for _ in range(PROBES):
            if not out:
                break
            seg = out[0]
            if seg.looks_free():
                ready.append(out.popleft())
            elif seg.seq <= old:
                slow.append(out.popleft())
            else:
                break
        if slow:
            seg = slow.popleft()
            (ready if seg.looks_free() else slow).append(seg)

    def discard(self, seg: Segment) -> bool:
        """Drop ``seg`` from every list (rare: its file vanished); True if it was ours."""
        if seg not in self.segments:
            return False
        self.segments.remove(seg)
        for q in (self.ready, self.out, self.slow):
            if seg in q:
                q.remove(seg)
        return True


def _link(src: str, dst: str, replace: Callable[[str], object], attempts: int) -> bool:
    """One more name ``dst`` for the segment at ``src``; an existing ``dst`` is replaced. False after ``attempts``
    or when the name cannot be made (``FileNotFoundError``: ``src`` is gone)."""
    for _ in range(attempts):
        try:
            os.link(src, dst)
            return True
        except FileExistsError:
            replace(dst)
        except FileNotFoundError:
            raise
        except OSError as exc:  # e.g. EPERM: a file of another user squats the name in the sticky directory
            log.warning("shm: cannot publish %s: %s", os.path.basename(dst), exc)
            return False
    return False


class ProducerPool:
    """Segments owned by one connector instance (``owner`` token), keyed by size class."""

    def __init__(self, directory: str, names: Names, owner: str, *, pool_bytes: int, max_segment: int) -> None:
        self._dir = directory
        self._names = names
        self._owner = owner
        self._pool_bytes = pool_bytes
        self._max_segment = max_segment
        self._classes: dict[int, SizeClass] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self.pooled_bytes = 0

    def _path(self, name: str) -> str:
        return f"{self._dir}/{name}"

    def writing_path(self, seg: Segment) -> str:
        return self._path(self._names.writing(self._owner, seg.no))

    def free_path(self, seg: Segment) -> str:
        return self._path(self._names.free(self._owner, seg.no))

    # -- acquire / publish / abandon ------------------------------------------------
    def acquire(self, payload_nbytes: int) -> Segment:
        """A segment named ``w.<owner>.<n>`` with room for the header plus ``payload_nbytes``."""
        total = PAYLOAD_OFFSET + payload_nbytes
        if self._pool_bytes and total <= self._max_segment:
            cap = size_class(total)
            with self._lock:
                group = self._classes.get(cap)
                seg = group.take() if group is not None else None
                if seg is not None:
                    return seg
                pooled = self.pooled_bytes + cap <= self._pool_bytes
                if pooled:
                    self.pooled_bytes += cap
                no = next(self._numbers)
            try:
                seg = self._create(no, cap, pooled)
            except BaseException:
                if pooled:
                    with self._lock:
                        self.pooled_bytes -= cap
                raise
            if pooled:
                with self._lock:
                    group = self._classes.get(cap)
                    if group is None:
                        group = self._classes[cap] = SizeClass()
                    group.segments.append(seg)
            return seg
        with self._lock:
            no = next(self._numbers)
        return self._create(no, round_up(total), pooled=False)

    def _create(self, no: int, cap: int, pooled: bool) -> Segment:
        path = self._path(self._names.writing(self._owner, no))
        seg = Segment(no, cap, create_segment(path, cap), pooled, path, self._path(self._names.free(self._owner, no)))
        seg.mark_busy()
        return seg

    def publish(self, seg: Segment, published_path: str) -> bool:
        """Rename the written segment to its key's name.

        Raises ``FileExistsError`` if the key is taken. Returns False if the segment's file
        vanished (gc'd because someone judged us dead); the caller retries with a new segment.
        """
        try:
            rename_noreplace(seg.path, published_path)
        except FileNotFoundError:
            self._forget(seg)
            return False
        self._published(seg)
        return True

    def publish_many(self, seg: Segment, paths: Sequence[str], replace: Callable[[str], object], attempts: int) -> list[bool] | None:
        """Publish the written segment under every path, one hard link each (see :mod:`.shared`); which got it.

        A name that exists is freed with ``replace(path)`` and linked again, up to ``attempts``
        times. The producer's own name goes once a name is made (consumers then hand the segment
        back); a segment published under no name stays the caller's to abandon. None when its file
        vanished before any name was made (gc'd: the caller retries with a new segment).
        """
        done: list[bool] = []
        try:
            with shared.locked(seg.path) if seg.pooled else contextlib.nullcontext():
                for path in paths:
                    done.append(_link(seg.path, path, replace, attempts))
                if any(done):
                    unlink_quiet(seg.path)
        except FileNotFoundError:  # our name vanished (gc --all): what was linked stands, the rest fails
            if not any(done):
                self._forget(seg)
                return None
            done += [False] * (len(paths) - len(done))
        if any(done):
            self._published(seg)
        return done

    def _published(self, seg: Segment) -> None:
        seg.uses += 1
        if seg.pooled:
            with self._lock:
                group = self._classes.get(seg.capacity)
                if group is not None:
                    group.publish(seg)
        else:
            seg.release_memory()  # the consumer unlinks it; we keep nothing

    def _forget(self, seg: Segment) -> None:
        log.warning("shm pool of %s: segment %d disappeared from %s; dropping it", self._owner, seg.no, self._dir)
        with self._lock:
            group = self._classes.get(seg.capacity)
            if group is not None and group.discard(seg):
                self.pooled_bytes -= seg.capacity
        seg.uses += 1  # records of its publications (ttl) are stale now: never read the released mapping
        seg.release_memory()

    def abandon(self, seg: Segment) -> None:
        """Undo an ``acquire`` whose payload was not published."""
        if seg.pooled:
            if seg.path == self.writing_path(seg):
                try:
                    os.rename(seg.path, self.free_path(seg))
                except FileNotFoundError:
                    self._forget(seg)
                    return
            seg.view[STATE_OFFSET] = STATE_FREE
            with self._lock:
                group = self._classes.get(seg.capacity)
                if group is not None:
                    group.ready.append(seg)
        else:
            unlink_quiet(seg.path)
            seg.release_memory()

    # -- shutdown -----------------------------------------------------------------
    def close(self) -> None:
        """Unlink every free/writing name of this pool and drop the mappings.

        Segments currently published or claimed are not here under our names; their
        consumer unlinks them on return because our marker is gone (see the connector).
        """
        with self._lock:
            segs = [s for group in self._classes.values() for s in group.segments]
            self._classes.clear()
            self.pooled_bytes = 0
        for seg in segs:  # flag first, unlink second (consumers check the flag after returning a segment)
            seg.view[CLOSED_OFFSET] = 1
        for seg in segs:
            unlink_quiet(self.free_path(seg))
            unlink_quiet(self.writing_path(seg))
            seg.release_memory()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"pooled_segments": sum(len(v.segments) for v in self._classes.values()), "pooled_bytes": self.pooled_bytes}
