"""The namespace's slot table: payloads handed off by compare-and-swap, no file syscall per hop.

``<shm_dir>/omnishm.<namespace>.d/omnishm.<namespace>.x.slots`` (mode 0600) is one shared mapping per
namespace: a 4 KiB header (magic, geometry, counters) and fixed tables of slots in *size classes*: the
small class (``slot_count`` x ``slot_bytes``, addressed by the key's hash) and a few classes of larger
slots (``slot_classes``). Each slot has a 64-bit state word ``pid << 32 | (start & 0xFFFFFF) << 8 | kind``
(FREE / WRITING / READY / CLAIMED, with the owning process), the key's hash and bytes (the full key is
compared), the producer's instance tag, the publish time and the payload. A key probes :data:`PROBES`
buckets from its hash in the small class; a class of at most :data:`PROBES` slots is searched whole from
its first slot, so its lowest free slot is reused and the slots in use stay the same few (their tmpfs
pages stay faulted in, the others are never touched). All of it runs in the C extension
(:mod:`omni_plugins_shm._native`): a ``put`` is one call (CAS FREE -> WRITING in the smallest class that
holds the encoding, encode straight into the slot, replace a READY slot of the key, store READY, ring the
key's wake slot), a ``get`` one call (CAS READY -> CLAIMED, copy out, FREE). Payloads larger than the
largest slot, keys longer than :data:`KEY_MAX` bytes and full classes go the file path (``connector.py``)
transparently.

Memory: the file is sparse, so a slot costs memory once used, and never more than the table's geometry.
A slot of a larger class that stays FREE for ``slot_idle_seconds`` gives its pages back
(``MADV_REMOVE``; puts, waits that run out and gc check at most a few times per ``slot_idle_seconds``): a
burst of large payloads does not keep its memory. The small class is not trimmed. A put makes sure the
pages it writes exist first (``MADV_POPULATE_WRITE``), so a full tmpfs is an error, not a SIGBUS.

Creation is race-free: the first instance writes the header into a private temporary file and
``link``\\ s it to the final name (an existing one wins; its geometry rules). Lifecycle as the wake
file's (:mod:`omni_plugins_shm.wakeslots`): every live instance holds a shared ``flock``; the last one
to close (or gc) removes it under an exclusive one.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import itertools
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from omni_plugins.errors import ConnectorError
from omni_plugins_shm import wakeslots
from omni_plugins_shm.proc import Owner, running_start_time

MAGIC = b"OMNISLT2"
VERSION = 2
HEADER = 4096
SLOT_HEADER = 256
KEY_MAX = SLOT_HEADER - 64
PROBES = 16
#: size classes a table can have (the small one and up to three larger ones)
MAX_CLASSES = 4
PAGE = mmap.PAGESIZE
#: header layout (see the C extension): u32 slots at 12, u32 classes at 16, u64 idle ns at 24, class table at 128
_CLASS_OFF = 128
_CLASS = struct.Struct("<IIQQQ")  # slots, first index, slot bytes, stride, offset
_COUNT_OFF = 512  # a u64 per class (64 bytes apart): its READY slots, an upper bound
FREE, WRITING, READY, CLAIMED = 0, 1, 2, 3
#: added to the seq :meth:`SlotTable.take` returns when file-path payloads may be waiting (the table's hint is not 0)
FILES = 1 << 32
SEQ_MASK = FILES - 1
#: added to :meth:`SlotTable.take_wait`'s miss when its sleep ran out its time
TIMED_OUT = 1 << 33
#: :meth:`SlotTable.put_obj` results other than a size
TOO_BIG, NO_SLOT, DEFERRED = -1, -2, -3


def state_word(pid: int, start: int, kind: int) -> int:
    """The state word of a slot in state ``kind`` owned by process ``(pid, start)``."""
    return (pid << 32) | ((start & 0xFFFFFF) << 8) | kind


def word_kind(word: int) -> int:
    return word & 0xFF


def word_owner_alive(word: int) -> bool:
    """Whether the process named in a state word still runs (pid plus the low 24 bits of its start time)."""
    start = running_start_time(word >> 32)
    return start is not None and start & 0xFFFFFF == (word >> 8) & 0xFFFFFF


class SlotClass(NamedTuple):
    """One size class of a table: ``nslots`` slots of ``slot_bytes`` payload bytes each."""

    nslots: int
    slot_bytes: int


#: what :meth:`SlotTable.take` and its kin return for a lent payload (``lend=True``): ``(slot index, offset of the
#: payload in the table's mapping, length)``; the slot stays claimed until :meth:`SlotTable.release`
Lent = tuple[int, int, int]


class SlotInfo(NamedTuple):
    """A snapshot of one slot that is not FREE (:meth:`SlotTable.scan`)."""

    slot: int
    word: int
    tag: int
    published: float
    key: bytes


class SlotTable:
    """One instance's handle on its namespace's slot table (shared ``flock`` held until :meth:`close`)."""

    #: ``take(key)``: the payload of ``key`` (claimed, copied out and freed: a ``bytearray``), or the key's wake slot seq read
    #: before looking, plus :data:`FILES` when the table's file-path hint is not 0 (read after looking: with 0, a
    #: file payload published after the look rings after the seq was read, so a sleep on it ends at once); None for
    #: a key the table cannot hold (lone surrogates). ``ValueError``: a corrupt slot (freed) or a closed mapping.
    #: A C function with the table's arguments bound (``functools.partial``): no Python frame on the hot path.
    take: Callable[[str], bytearray | int | None]
    #: ``lend``, ``lend_wait``, ``lend_or_wait``: :attr:`take`, :attr:`take_wait`, :attr:`take_or_wait` for zero-copy
    #: gets: a payload of a larger class comes back as :data:`Lent` (no copy; the slot stays claimed until
    #: :meth:`release`), one of the small class as a copy (a ``bytearray``) still
    lend: Callable[[str], bytearray | Lent | int | None]
    lend_wait: Callable[[str, int, float], bytearray | Lent | int | None]
    lend_or_wait: Callable[[str, float], bytearray | Lent | int | None]
    #: ``take_wait(key, expected, seconds)``: sleep up to ``seconds`` while the key's wake slot still reads
    #: ``expected`` (a seq :attr:`take` returned: read before its look, and so before the caller's file-path
    #: check), then :attr:`take`; a miss after a sleep that ran out its time has :data:`TIMED_OUT` added. One C
    #: call for the wait and the look after it (the hot path of a blocked ``get``).
    take_wait: Callable[[str, int, float], bytearray | int | None]
    #: ``take_or_wait(key, seconds)``: :attr:`take`; on a miss while the file-path hint is 0, sleep up to
    #: ``seconds`` on the seq that look read and look once more (its miss then has :data:`TIMED_OUT` added if
    #: the sleep ran out). A blocking get's first look, sleep and second look in one C call.
    take_or_wait: Callable[[str, float], bytearray | int | None]
    #: ``put_obj(key, encoder, data)``: encode ``data`` straight into a slot with ``encoder`` (the compiled
    #: encoder's C API, ``omni_plugins.wire.native_c_api()``, called with the slot's address; anything else is a
    #: ``TypeError``), replace an unconsumed payload of the key, publish and ring:
    #: one C call, no :class:`~omni_plugins.wire.Encoded`. The encoded size, or :data:`TOO_BIG` (key or encoding
    #: too big, or a key without UTF-8 bytes: take the file path), :data:`NO_SLOT` (no free bucket: file path) or
    #: :data:`DEFERRED` (the compiled encoder declined: encode in Python). Bound like :attr:`take`.
    put_obj: Callable[[str, Any, Any], int]

    def __init__(self, path: str, fd: int, mm: mmap.mmap, owner: Owner, wake: mmap.mmap | None) -> None:
        # imported here: the wire codec imports torch (2 s), which gc and its CLI (this module's functions) never need
        from omni_plugins.wire import DEFAULT_LIMITS

        native = wakeslots._futex
        assert native is not None
        self._native = native
        self.path = path
        self._fd = fd
        self.mm = mm
        self._wake = wake
        #: the table's size classes (its geometry: the first instance of the namespace set it)
        self.classes = geometry(mm)
        #: the largest encoded payload a slot holds
        self.slot_bytes = self.classes[-1].slot_bytes
        self.nslots = sum(c.nslots for c in self.classes)
        self.tag = owner.tag
        self.start = owner.start
        self.writing = state_word(owner.pid, owner.start, WRITING)
        self.ready = state_word(owner.pid, owner.start, READY)
        self.claimer = state_word(owner.pid, owner.start, CLAIMED)
        self.take = functools.partial(native.slot_take, mm, self.claimer, wake, False)
        self.take_wait = functools.partial(native.slot_take_wait, mm, self.claimer, wake, False)
        self.take_or_wait = functools.partial(native.slot_take_or_wait, mm, self.claimer, wake, False)
        self.lend = functools.partial(native.slot_take, mm, self.claimer, wake, True)
        self.lend_wait = functools.partial(native.slot_take_wait, mm, self.claimer, wake, True)
        self.lend_or_wait = functools.partial(native.slot_take_or_wait, mm, self.claimer, wake, True)
        self.put_obj = functools.partial(native.slot_put_obj, mm, self.writing, self.ready, self.claimer, self.tag, self.start, wake, DEFAULT_LIMITS)

    @classmethod
    def open(
        cls,
        directory: str,
        name: str,
        owner: Owner,
        classes: Sequence[SlotClass],
        idle_seconds: float,
        ensure_dir: object,
        wake: mmap.mmap | None,
    ) -> SlotTable:
        """Open (creating if needed) the table ``directory/name`` with size ``classes`` (ascending slot sizes) and
        ``idle_seconds`` before an idle slot of a larger class gives its pages back (if it is new); its puts ring
        and its takes read the wake file mapping ``wake``."""

        def create(path: str) -> int:
            try:
                return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                _create(path, owner, classes, idle_seconds)
                raise  # open_locked tries again (the new table, or one a racing instance linked first)

        path, fd, mm = wakeslots.open_locked(directory, name, ensure_dir, create, _map, "slot table")
        try:
            return cls(path, fd, mm, owner, wake)
        except BaseException:  # e.g. an extension older than this module: leave no table (or lock) behind
            mm.close()
            _close_locked(path, fd)
            raise

    # -- hot path (one C call each) ------------------------------------------------------
    def put(self, key: str, buffers: list[memoryview], nbytes: int) -> int:
        """Publish and ring the key's wake slot; the slot index, or < 0 when the payload must take the file path
        (too big, key longer than :data:`KEY_MAX` bytes or not UTF-8 encodable, no free slot among the key's buckets)."""
        try:
            return int(
                self._native.slot_put(self.mm, key, self.writing, self.ready, self.claimer, self.tag, self.start, buffers, nbytes, self._wake)
            )
        except UnicodeEncodeError:
            return -1

    def files_add(self, delta: int) -> int:
        """Add ``delta`` to the hint of unconsumed file-path payloads (never below 0); the new value.

        Producers with the table raise it before a file-path publication (and mark the segment
        ``counted``), the get that consumes a counted segment lowers it. Too high is harmless (a
        waiting get then tries the file path, as it always did); it is never too low among instances
        with the table (those without it do not look into the table, see docs/backends/shm.md).
        """
        return int(self._native.slot_files(self.mm, delta))

    def present(self, keys: list[str]) -> list[int]:
        """Indexes of ``keys`` with a READY slot."""
        return self._native.slot_present(self.mm, keys)  # type: ignore[no-any-return]

    def ready_among(self, keys: AbstractSet[str]) -> list[str]:
        """The keys in ``keys`` (a set or a dict's keys view) with a READY slot: one look at each READY slot's key,
        so the cost does not grow with ``keys``; with more READY slots than half the keys (a consumer far behind),
        :meth:`present`'s probe per key, which then costs less."""
        found: list[str] | None = self._native.slot_ready_among(self.mm, keys)
        if found is None:
            listed = list(keys)
            found = [listed[i] for i in self.present(listed)]
        return found

    def release(self, index: int) -> None:
        """Free the lent slot ``index`` (the last view of a zero-copy result died). Never raises: a finalizer calls it."""
        try:
            self._native.slot_release(self.mm, self.claimer, index)
        except (ValueError, IndexError):  # pragma: no cover - the mapping is exported while views live
            pass

    def trim(self, before: float) -> int:
        """Give back the pages of the larger classes' slots FREE since before ``before`` (``time.time()``); bytes."""
        return int(self._native.slot_trim(self.mm, self.writing, before))

    def slot_offset(self, index: int) -> int:
        """Where slot ``index`` (its header; the payload follows at :data:`SLOT_HEADER`) starts in :attr:`mm`."""
        for count, first, _, stride, offset in layout(self.classes)[0]:
            if index < first + count:
                return offset + (index - first) * stride
        raise IndexError(f"slot {index} of a table of {self.nslots}")

    def trim_due(self) -> None:
        """Give back the memory of idle larger slots if the table's trim is due (a wait that ran out calls it)."""
        self._native.slot_trim_due(self.mm, self.writing)

    def ready_counts(self) -> list[int]:
        """Each larger class's count of READY slots (an upper bound: a look skips a class whose count is 0)."""
        return [int.from_bytes(self.mm[_COUNT_OFF + 64 * c : _COUNT_OFF + 64 * c + 8], "little") for c in range(1, len(self.classes))]

    def committed_bytes(self) -> int:
        """Memory the table holds now (its tmpfs pages)."""
        try:
            return os.fstat(self._fd).st_blocks * 512 if self._fd >= 0 else 0
        except OSError:
            return 0

    def unlinked(self) -> bool:
        """Whether the table was removed under us (``gc --all``): peers that start now use a new one."""
        try:
            return self._fd >= 0 and os.fstat(self._fd).st_nlink == 0
        except OSError:
            return False

    # -- bookkeeping (close, ttl, gc) ------------------------------------------------------
    def scan(self) -> list[SlotInfo]:
        return [SlotInfo(*item) for item in self._native.slot_scan(self.mm)]

    def free_mine(self, older_than: float | None = None) -> int:
        """Free this instance's READY slots (published before ``older_than``, if given); how many."""
        freed = 0
        for info in self.scan():
            if info.word != self.ready or info.tag != self.tag or (older_than is not None and info.published >= older_than):
                continue
            if not self._native.slot_cas(self.mm, info.slot, info.word, self.claimer):
                continue  # consumed meanwhile
            if self._native.slot_tag(self.mm, info.slot) == self.tag:
                self._native.slot_cas(self.mm, info.slot, self.claimer, FREE)
                freed += 1
            else:  # another instance of this process republished it in between: put it back
                self._native.slot_cas(self.mm, info.slot, self.claimer, info.word)
        return freed

    def close(self) -> bool:
        """Drop our lock; remove the file if no other live instance holds it. True if removed."""
        if self._fd < 0:
            return False
        removed = _close_locked(self.path, self._fd)
        try:
            self.mm.close()
        except BufferError:
            pass  # zero-copy views of lent slots are alive: the mapping goes with the last of them
        self._fd = -1
        return removed


def _close_locked(path: str, fd: int) -> bool:
    removed = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
    else:
        removed = wakeslots._unlink_if_same(path, fd)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return removed


def first_slot_for(classes: Sequence[SlotClass], nbytes: int) -> int:
    """The index of the first slot of the smallest class holding ``nbytes`` (the table's size if none does)."""
    first = 0
    for c in classes:
        if c.slot_bytes >= nbytes:
            return first
        first += c.nslots
    return first


def class_of(classes: Sequence[SlotClass], index: int) -> int:
    """The class (its position in ``classes``) of slot ``index``."""
    for i, c in enumerate(classes):
        if index < c.nslots:
            return i
        index -= c.nslots
    raise IndexError("slot index out of range")


def layout(classes: Sequence[SlotClass]) -> tuple[list[tuple[int, int, int, int, int]], int]:
    """The class table ``(slots, first index, slot bytes, stride, offset)`` of ``classes`` and the file size.

    The small class follows the header with a 64-byte stride; each larger class starts on a page and has a
    page stride, so the trim gives back whole pages of a slot and keeps only its first (the slot header).
    """
    rows, at, first = [], HEADER, 0
    for i, (count, slot_bytes) in enumerate(classes):
        stride = (SLOT_HEADER + slot_bytes + 63) & ~63 if i == 0 else -(-(SLOT_HEADER + slot_bytes) // PAGE) * PAGE
        if i:
            at = -(-at // PAGE) * PAGE
        rows.append((count, first, slot_bytes, stride, at))
        at += count * stride
        first += count
    return rows, at


def _create(path: str, owner: Owner, classes: Sequence[SlotClass], idle_seconds: float) -> None:
    """Write a new table to a temporary name and link it to ``path`` (an existing table wins)."""
    tmp = f"{path}.{owner.token}"
    rows, size = layout(classes)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # gc leaves a locked temporary alone
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)  # sparse: slots cost memory once used
        try:
            # the header and every slot's header page exist from the start: a look at a slot (a get, gc's scan)
            # never faults a page into a full tmpfs (a SIGBUS); a slot's payload pages are had by the put that uses it
            os.posix_fallocate(fd, 0, HEADER)
            for count, _, _, stride, offset in rows:
                for i in range(count):
                    os.posix_fallocate(fd, offset + i * stride, SLOT_HEADER)
        except OSError as exc:
            raise ConnectorError(
                f"shm slot table {path}: no room for its {sum(r[0] for r in rows)} slot headers ({exc}); free space in "
                f"{os.path.dirname(os.path.dirname(path))} or lower slot_count"
            ) from None
        head = MAGIC + VERSION.to_bytes(4, "little") + sum(r[0] for r in rows).to_bytes(4, "little") + len(rows).to_bytes(4, "little")
        os.pwrite(fd, head, 0)
        os.pwrite(fd, int(idle_seconds * 1e9).to_bytes(8, "little"), 24)
        os.pwrite(fd, b"".join(_CLASS.pack(*r) for r in rows), _CLASS_OFF)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except FileNotFoundError:
            pass  # the directory or the temporary went away (gc): the caller tries again
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.close(fd)


def geometry(head: bytes | mmap.mmap) -> list[SlotClass]:
    """The size classes a table header declares (``ValueError`` if they are not a valid layout)."""
    if head[:8] != MAGIC:
        raise ValueError("bad magic (not a slot table of this version)")
    nslots, nclasses = struct.unpack_from("<II", head, 12)
    if not 1 <= nclasses <= MAX_CLASSES:
        raise ValueError(f"{nclasses} size classes")
    rows = [_CLASS.unpack_from(head, _CLASS_OFF + i * _CLASS.size) for i in range(nclasses)]
    classes = [SlotClass(r[0], r[2]) for r in rows]
    if any(c.nslots <= 0 or c.slot_bytes <= 0 for c in classes) or sum(c.nslots for c in classes) != nslots:
        raise ValueError("slot counts do not add up")
    if any(b.slot_bytes <= a.slot_bytes for a, b in itertools.pairwise(classes)):
        raise ValueError("size classes do not ascend")
    if [tuple(r) for r in rows] != layout(classes)[0]:
        raise ValueError("class table does not match its classes")
    return classes


def _map(path: str, fd: int, st: os.stat_result) -> mmap.mmap:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise ConnectorError(f"shm slot table {path} is not a regular file of this user; remove it")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    head = os.pread(fd, HEADER, 0)
    try:
        classes = geometry(head)
        if layout(classes)[1] != st.st_size:
            raise ValueError(f"{st.st_size} bytes, not what its classes need")
    except (ValueError, struct.error) as exc:
        raise ConnectorError(f"shm slot table {path} has an invalid header ({exc}); remove it (omni-plugins shm gc --all)") from None
    return mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class Reclaimed(NamedTuple):
    """What :func:`reclaim` did to one table."""

    slots: int  #: slots of dead processes freed
    removed: bool  #: the table itself was removed (no live instance held it)
    trimmed: int = 0  #: bytes of idle slots given back


def reclaim(path: str, dry_run: bool = False) -> Reclaimed:
    """gc of one table: free WRITING/CLAIMED slots of dead processes and READY slots of dead producers,
    then give back the pages of slots idle longer than the table's idle time (as its puts do).

    The table is removed when no live instance holds it.
    Each slot is freed by a compare-and-swap of exactly the word judged dead, so a slot that changed
    hands meanwhile is left alone.
    """
    native = wakeslots._futex
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return Reclaimed(0, False)
    freed = trimmed = 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:  # nobody holds it: remove it (its payloads' producers are all gone)
            if dry_run:
                return Reclaimed(0, True)
            return Reclaimed(0, wakeslots._unlink_if_same(path, fd))
        if native is None:
            return Reclaimed(0, False)
        try:
            mm = _map(path, fd, os.fstat(fd))
        except ConnectorError:
            return Reclaimed(0, False)
        try:
            for item in native.slot_scan(mm):
                info = SlotInfo(*item)
                if word_owner_alive(info.word):
                    continue
                if (not dry_run and native.slot_cas(mm, info.slot, info.word, FREE)) or dry_run:
                    freed += 1
            idle_ns = int.from_bytes(mm[24:32], "little")
            if idle_ns and not dry_run:
                me = Owner.new()
                trimmed = native.slot_trim(mm, state_word(me.pid, me.start, WRITING), time.time() - idle_ns / 1e9)
        finally:
            mm.close()
        return Reclaimed(freed, False, trimmed)
    finally:
        os.close(fd)


def _map_existing(path: str) -> mmap.mmap | None:
    """The table at ``path`` mapped read-write for gc's one-off edits; None if it is missing or not a valid table of ours."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        return _map(path, fd, os.fstat(fd))
    except ConnectorError:
        return None
    finally:
        os.close(fd)  # the mapping outlives the descriptor


def lower_files_hint(path: str, count: int) -> None:
    """Lower the file-path hint of the table at ``path`` by ``count`` (gc freed that many counted file payloads).

    A hint left too high costs every waiting get of the namespace a ``rename`` per sleep for the table's
    life; a missing or foreign table is left alone.
    """
    native = wakeslots._futex
    if native is None or count <= 0:
        return
    mm = _map_existing(path)
    if mm is None:
        return
    try:
        native.slot_files(mm, -count)
    finally:
        mm.close()


def expire(path: str, seconds: float, now: float, dry_run: bool = False) -> int:
    """gc --ttl: free READY slots published more than ``seconds`` before ``now`` (any producer)."""
    native = wakeslots._futex
    if native is None:
        return 0
    mm = _map_existing(path)
    if mm is None:
        return 0
    freed = 0
    me = Owner.new()
    claimer = state_word(me.pid, me.start, CLAIMED)
    try:
        for item in native.slot_scan(mm):
            info = SlotInfo(*item)
            if word_kind(info.word) != READY or now - info.published <= seconds:
                continue
            if dry_run:
                freed += 1
            elif native.slot_cas(mm, info.slot, info.word, claimer):
                # claimed: re-read its age (the producer may have republished the slot in between)
                again = [SlotInfo(*x) for x in native.slot_scan(mm) if x[0] == info.slot]
                if again and now - again[0].published > seconds:
                    native.slot_cas(mm, info.slot, claimer, FREE)
                    freed += 1
                else:
                    native.slot_cas(mm, info.slot, claimer, info.word)
    finally:
        mm.close()
    return freed
