"""The namespace's wake file: futex words that wake a blocked ``get`` without inotify.

``<shm_dir>/omnishm.<namespace>.d/omnishm.<namespace>.x.wake`` (mode 0600, one page) holds
:data:`~omni_plugins_shm.naming.WAKE_SLOTS` *wake slots* of two 32-bit words each: ``seq`` and ``waiters``. A key maps to
one slot (first byte of its BLAKE2b digest). A producer bumps the key's slot after each
publishing rename; a ``get`` waiting for a key sleeps in ``FUTEX_WAIT`` on that slot's
``seq`` (C extension :mod:`omni_plugins_shm._native`), so the wake-up is one syscall on each
side and only when someone waits (the producer skips ``FUTEX_WAKE`` while ``waiters`` is 0),
instead of an inotify event per publication plus ``poll`` + ``read`` per wake-up. The
publication itself stays a rename (the file names remain the truth for consume-once, crash
recovery, gc, ttl); the slot is only a doorbell, so a missed or spurious ring costs time,
never correctness:

- a spurious wake (another key of the same slot) costs one failed claim ``rename``;
- a lost wake (a producer SIGKILLed between its rename and its bump, a republish by gc or
  ttl, which do not ring) is caught by the waiter's safety re-check every :data:`SLICE`
  seconds;
- a consumer SIGKILLed while waiting leaves ``waiters`` raised: producers then issue a
  ``FUTEX_WAKE`` that wakes nobody (a few microseconds) on that slot until the namespace's
  last instance closes and the file goes.

Without the C extension (pure-Python install) waits use inotify (:mod:`notify`); such a
producer still rings: it bumps ``seq`` without atomics and always calls ``FUTEX_WAKE``
through ctypes, so waiters of a mixed namespace are not left to the safety re-check.

Lifecycle: every live instance holds a shared ``flock`` on the file; whoever closes (or gc)
removes it only under an exclusive, non-blocking ``flock`` -- i.e. when no live instance
holds it (a dead process's locks are gone with it). An instance that opens the file checks,
after taking its shared lock, that it is still linked (else it lost the race against the
remover and opens again), so all live instances of a namespace share one file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Callable
from types import ModuleType

from omni_plugins.errors import ConnectorError
from omni_plugins_shm.naming import WAKE_ANY_SLOT, WAKE_FIRST_SLOT, WAKE_SLOTS


def _load_native() -> ModuleType | None:
    try:
        from omni_plugins_shm import _native
    except ImportError:  # pragma: no cover - the pure-Python install (tests force it per connector)
        return None
    return _native


#: the C extension's futex calls, or None (pure Python; tests set None to force that path)
_futex = _load_native()

MAGIC = b"OMNIWAK1"
SIZE = mmap.PAGESIZE
#: a waiter re-checks its key at least this often (catches rings lost to a crash)
SLICE = 0.5
_ATTEMPTS = 16
_SYS_FUTEX = 202  # x86_64; the ctypes ring is only used on x86_64 (elsewhere the fallback skips it)
_FUTEX_WAKE = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_CTYPES_RING = os.uname().machine == "x86_64"

assert WAKE_FIRST_SLOT + 8 * WAKE_SLOTS <= SIZE


def available() -> bool:
    """True when the C extension is there (futex waits); False means waits use inotify."""
    return _futex is not None


class WakeFile:
    """One instance's handle on its namespace's wake file (shared ``flock`` held until :meth:`close`)."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, use_futex: bool) -> None:
        self.path = path
        self._fd = fd
        self.mm = mm
        self._futex = _futex if use_futex else None
        self._words = (ctypes.c_uint32 * (SIZE // 4)).from_buffer(mm) if self._futex is None else None

    @property
    def futex_waits(self) -> bool:
        """Whether blocked gets of this instance sleep on futex words (else on inotify)."""
        return self._futex is not None

    @classmethod
    def open(cls, directory: str, name: str, ensure_dir: object, use_futex: bool = True) -> WakeFile:
        """Open (creating if needed) ``directory/name``, take the shared lock, map it.

        ``ensure_dir``: a callable creating the publish directory (it may vanish while the last
        other instance closes; then we create it again).
        """

        def create(path: str) -> int:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)

        path, fd, mm = open_locked(directory, name, ensure_dir, create, _map, "wake file")
        return cls(path, fd, mm, use_futex and _futex is not None)

    # -- producer ---------------------------------------------------------------------
    def ring(self, offset: int) -> None:
        """A payload was just published under a key of slot ``offset``: wake its waiters."""
        fx = self._futex
        if fx is not None:
            fx.bump(self.mm, offset)
            fx.bump(self.mm, WAKE_ANY_SLOT)
            return
        words = self._words
        if words is None:  # pragma: no cover - closed
            return
        for off in (offset, WAKE_ANY_SLOT):
            self._ring_ctypes(words, off)

    def ring_any(self) -> None:
        """Ring only the namespace-wide slot (``wait_any`` waiters re-check; ``interrupt_wait``)."""
        fx = self._futex
        if fx is not None:
            fx.bump(self.mm, WAKE_ANY_SLOT)
        elif self._words is not None:
            self._ring_ctypes(self._words, WAKE_ANY_SLOT)

    @staticmethod
    def _ring_ctypes(words: ctypes.Array[ctypes.c_uint32], offset: int) -> None:
        i = offset // 4
        words[i] = (words[i] + 1) & 0xFFFFFFFF  # not atomic: only a change signal (see the module doc)
        if _CTYPES_RING:
            # syscall() is variadic: every argument typed explicitly (a bare int would be passed as a 32-bit int)
            _syscall(
                ctypes.c_long(_SYS_FUTEX),
                ctypes.c_void_p(ctypes.addressof(words) + offset),
                ctypes.c_int(_FUTEX_WAKE),
                ctypes.c_int(0x7FFFFFFF),
                None,
                None,
                ctypes.c_int(0),
            )

    # -- consumer ---------------------------------------------------------------------
    def seq(self, offset: int) -> int:
        """The slot's current value (``ValueError`` once :meth:`close` unmapped it)."""
        assert self._futex is not None
        return int(self._futex.load(self.mm, offset))

    def sleep(self, offset: int, seen: int, seconds: float) -> bool:
        """Sleep up to ``seconds`` (capped at :data:`SLICE`) while slot ``offset`` still reads ``seen``."""
        assert self._futex is not None
        return bool(self._futex.wait(self.mm, offset, seen, min(seconds, SLICE)))

    def spin(self, offset: int, seen: int, seconds: float) -> bool:
        """Busy-poll up to ``seconds`` (at most 1) while slot ``offset`` still reads ``seen``; True if it changed.

        The GIL is let go meanwhile, but a core is burnt: see :meth:`ShmConnector.poll_any`.
        """
        assert self._futex is not None
        return bool(self._futex.spin(self.mm, offset, seen, min(seconds, 1.0)))

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> bool:
        """Drop our lock; remove the file if no other live instance holds it. True if removed."""
        if self._fd < 0:
            return False
        removed = False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:
            removed = _unlink_if_same(self.path, self._fd)
        self._words = None
        # unlock explicitly: the mmap holds a dup of the fd (same open file, same lock), and a
        # thread still sleeping on the mapping keeps it open past our close
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        try:
            self.mm.close()
        except BufferError:
            pass  # a thread still sleeps on it; the mapping goes when that wait returns
        os.close(self._fd)
        self._fd = -1
        return removed


def open_locked(
    directory: str,
    name: str,
    ensure_dir: object,
    create: Callable[[str], int],
    mapper: Callable[[str, int, os.stat_result], mmap.mmap],
    what: str,
) -> tuple[str, int, mmap.mmap]:
    """Open a namespace-wide file ``directory/name`` (``create(path)`` -> fd; ``FileNotFoundError`` = try again),
    take the shared ``flock`` every live instance holds, check it is still linked, map it with ``mapper``.

    ``ensure_dir``: a callable creating the publish directory (it may vanish while the last other
    instance closes; then we create it again). Returns ``(path, fd, mapping)``.
    """
    path = f"{directory}/{name}"
    for _ in range(_ATTEMPTS):
        ensure_dir(directory)  # type: ignore[operator]
        try:
            fd = create(path)
        except FileNotFoundError:
            continue  # the directory went away with its last other instance (or the file was just created)
        except OSError as exc:
            raise ConnectorError(f"shm {what} {path}: cannot open: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            if st.st_nlink == 0:
                os.close(fd)
                continue  # removed by the last other instance between our open and lock
            mm = mapper(path, fd, st)
        except BaseException:
            os.close(fd)
            raise
        return path, fd, mm
    raise ConnectorError(f"shm {what} {path} keeps disappearing (is gc --all running?)")


def remove_if_unused(path: str, dry_run: bool = False) -> bool:
    """Remove the wake file at ``path`` if no live instance holds its lock (gc). True if (it would be) removed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True if dry_run else _unlink_if_same(path, fd)
    finally:
        os.close(fd)


def _unlink_if_same(path: str, fd: int) -> bool:
    """Unlink ``path`` if it is still the file open at ``fd`` (we hold its exclusive lock)."""
    try:
        same = os.path.samestat(os.lstat(path), os.fstat(fd))
    except FileNotFoundError:
        return False
    if same:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
    return same


def _map(path: str, fd: int, st: os.stat_result) -> mmap.mmap:
    """Check, size and map the wake file open at ``fd`` (we hold its shared lock)."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise ConnectorError(f"shm wake file {path} is not a regular file of this user; remove it")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    if st.st_size < SIZE:
        os.ftruncate(fd, SIZE)  # only ever grows; concurrent openers agree on SIZE
    mm = mmap.mmap(fd, SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    head = mm[: len(MAGIC)]
    if head == bytes(len(MAGIC)):
        mm[: len(MAGIC)] = MAGIC
    elif head != MAGIC:
        mm.close()
        raise ConnectorError(f"shm wake file {path} has unknown contents (magic {head!r}); remove it")
    return mm
