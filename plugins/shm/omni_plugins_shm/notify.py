"""Waiting for a key without polling: inotify on the namespace's publish directory.

Publishing a payload is a rename to the key's name in the publish directory
(:mod:`omni_plugins_shm.pubdir`), which the kernel reports as ``IN_MOVED_TO``;
claims move names out of it and returns happen in the shm directory, so neither
wakes a waiter. A waiting ``get`` blocks in ``poll()`` on
an inotify descriptor and retries its claim only when an event names its key
(or the event queue overflowed), so an idle consumer costs no CPU and wakes
within microseconds of the ``put``.

Each thread gets its own inotify instance per connector, created on first use
and reused: creating and closing one per ``get`` would cost far more than the
wait (closing an inotify instance waits for an RCU grace period). The wait
order -- drain stale events, then claim, then sleep -- means a ``put`` that
lands between the claim attempt and the sleep still wakes the waiter.

If inotify is unavailable (e.g. ``max_user_instances`` reached) waits fall
back to sleeping with exponential backoff (0.2 ms up to 20 ms) and a warning
is logged once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import math
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from omni_plugins.backoff import Backoff

log = logging.getLogger(__name__)

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")
_BUF = 64 * 1024
#: one poll() sleeps at most this long (an infinite timeout must not overflow poll's int)
_MAX_SLEEP = 3600.0
#: a tracked set of published names larger than this is rebuilt from a directory scan
_SEEN_MAX = 8192
#: without inotify: lstat checks 0.2 ms apart, doubling up to 20 ms
_POLL_BACKOFF = (0.0002, 0.02)
#: stands for a queue overflow among the names read (not a valid file name)
OVERFLOW = b"/"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]

T = TypeVar("T")


class _Watch:
    """One inotify instance watching one directory for entries appearing.

    With tracking on (the first :meth:`Notifier.wait_any` of its thread turns it
    on) it also keeps ``seen``: the published names (``prefixes``) that appeared
    since tracking started -- seeded from a directory scan, fed by every event
    this watch reads (also while a plain ``get`` waits on it), rebuilt from a
    scan after a queue overflow or when it grows past ``_SEEN_MAX``. Entries
    may be stale (claimed since); a waiter verifies candidates with ``lstat``.
    """

    def __init__(self, directory: str) -> None:
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        if _libc.inotify_add_watch(fd, os.fsencode(directory), IN_MOVED_TO | IN_CREATE) < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"inotify_add_watch({directory}): {os.strerror(err)}")
        self.fd = fd
        self.busy = False
        self._dir = directory
        self._bdir = os.fsencode(directory) + b"/"
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self.seen: set[bytes] | None = None
        self._prefixes: tuple[bytes, ...] = ()
        #: the watched directory is gone (removed by ``gc --all``): waits fall back to sleeping
        self.dead = False

    def _read(self) -> list[bytes] | None:
        """Names of the pending events (None: nothing pending); a queue overflow yields ``[OVERFLOW]``."""
        try:
            data = os.read(self.fd, _BUF)
        except BlockingIOError:
            return None
        names: list[bytes] = []
        off = 0
        while off + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
            if mask & (IN_Q_OVERFLOW | IN_IGNORED):
                names.append(OVERFLOW)
                if mask & IN_IGNORED:
                    self.dead = True
            else:
                names.append(data[off + _EVENT.size : off + _EVENT.size + length].rstrip(b"\0"))
            off += _EVENT.size + length
        seen = self.seen
        if seen is not None:
            if OVERFLOW in names or len(seen) > _SEEN_MAX:
                self._rescan()
            else:
                prefixes = self._prefixes
                seen.update(n for n in names if n.startswith(prefixes))
        return names

    def drain(self) -> None:
        while self._read() is not None:
            pass

    def track(self, prefixes: tuple[bytes, ...]) -> None:
        """Start (or keep) tracking published names; the scan happens after draining, so nothing falls between."""
        if self.seen is not None and prefixes == self._prefixes:
            return
        self._prefixes = prefixes
        self.drain()
        self._rescan()

    def _rescan(self) -> None:
        prefixes = self._prefixes
        try:
            with os.scandir(self._dir) as it:
                self.seen = {n for n in (os.fsencode(e.name) for e in it) if n.startswith(prefixes)}
        except OSError:
            self.seen = set()

    def forget(self, name: bytes) -> None:
        if self.seen is not None:
            self.seen.discard(name)

    def wait(self, names: frozenset[bytes], seconds: float) -> bool:
        """Sleep up to ``seconds`` for an event naming one of ``names``; True if one (or an overflow) came."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not self._poll.poll(math.ceil(min(remaining, _MAX_SLEEP) * 1000)):
                continue  # re-check the clock; poll's millisecond rounding must not end the wait early
            got = self._read()
            if got and (OVERFLOW in got or not names.isdisjoint(got)):
                return True

    def wait_any(self, wanted: Mapping[bytes, T], seconds: float) -> list[T]:
        """Up to ``seconds`` for any name in ``wanted`` to be present; the values of those that are.

        Needs :meth:`track` first. One full check against ``seen`` (verified by
        ``lstat``), then only the names of new events are compared with
        ``wanted``: an event for an unrelated name costs a read and a set test,
        and never ends the wait.
        """
        assert self.seen is not None
        deadline = time.monotonic() + seconds
        self.drain()
        candidates: Iterable[bytes] = wanted.keys() & self.seen  # C-level; iterates the smaller side
        while True:
            found = [wanted[n] for n in candidates if self._present(n)]
            if found:
                return found
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                if not self._poll.poll(math.ceil(min(remaining, _MAX_SLEEP) * 1000)):
                    continue
                got = self._read()
                if not got:
                    continue
                if OVERFLOW in got:
                    candidates = wanted.keys() & self.seen  # C-level; iterates the smaller side
                    break
                hits = [n for n in got if n in wanted]
                if hits:
                    candidates = hits
                    break

    def _present(self, name: bytes) -> bool:
        try:
            os.lstat(self._bdir + name)
        except FileNotFoundError:
            self.forget(name)
            return False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class Notifier:
    """Blocks a ``get`` until its key may have arrived; one inotify instance per (notifier, thread)."""

    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._local = threading.local()
        self._watches: list[_Watch] = []
        self._lock = threading.Lock()
        self._closed = False
        self._warned = False
        #: some thread's watch tracks published names (set by its first ``wait_any``)
        self._tracking = False

    def _watch(self) -> _Watch | None:
        watch: _Watch | None = getattr(self._local, "watch", None)
        if watch is not None or getattr(self._local, "failed", False):
            return watch
        try:
            watch = _Watch(self._dir)
        except OSError as exc:
            self._local.failed = True
            if not self._warned:
                self._warned = True
                hint = " (raise fs.inotify.max_user_instances)" if exc.errno in (errno.EMFILE, errno.ENFILE) else ""
                log.warning("inotify unavailable on %s: %s%s; blocking gets fall back to sleeping", self._dir, exc, hint)
            return None
        with self._lock:
            if self._closed:
                watch.close()
                return None
            self._watches.append(watch)
        self._local.watch = watch
        return watch

    def wait_for(self, names: frozenset[bytes], attempt: Callable[[], T | None], timeout: float) -> T | None:
        """Call ``attempt`` until it returns non-None or ``timeout`` seconds pass; sleep on inotify between tries.

        ``names``: the published names (bytes) whose events are worth a new attempt. No
        drain before the first attempt: an event that is already queued (stale) costs one
        extra attempt at most, and any publication after the attempt is queued, so it
        wakes the sleep that follows -- nothing is lost.
        """
        result = attempt()
        if result is not None:
            return result
        deadline = time.monotonic() + timeout
        watch = self._watch()
        if watch is not None:
            with self._lock:
                watch.busy = True
        backoff = Backoff(*_POLL_BACKOFF, deadline)
        try:
            while True:
                remaining = backoff.remaining()
                if remaining <= 0 or self._closed:
                    return None
                if watch is not None and not watch.dead:
                    watch.wait(names, remaining)
                else:
                    backoff.sleep()
                result = attempt()
                if result is not None:
                    return result
        finally:
            if watch is not None:
                self._release(watch)

    def _release(self, watch: _Watch) -> None:
        """End this thread's use of ``watch``; close it if the notifier closed or its directory vanished."""
        with self._lock:
            watch.busy = False
            if watch.dead and watch in self._watches:
                self._watches.remove(watch)
                self._local.watch = None  # the next wait watches the directory again (if it is back)
                watch.close()
            elif self._closed:  # close() left this watch to us because we were using it
                watch.close()

    def wait_any(self, wanted: Mapping[bytes, T], prefixes: tuple[bytes, ...], timeout: float) -> list[T]:
        """Values of ``wanted`` (published name -> key) whose names are present, waiting up to ``timeout``.

        One inotify watch per thread, as for ``get``; the thread's watch tracks
        the published names (``prefixes``) from its first call on. Without
        inotify it checks ``lstat`` with exponential backoff (0.2 ms up to 20 ms).
        """
        deadline = time.monotonic() + timeout
        watch = self._watch()
        if watch is None:
            bdir = os.fsencode(self._dir) + b"/"
            backoff = Backoff(*_POLL_BACKOFF, deadline)
            while True:
                found = [k for n, k in wanted.items() if os.path.lexists(bdir + n)]
                if found or self._closed or not backoff.sleep():
                    return found
        with self._lock:
            watch.busy = True
        try:
            self._tracking = True
            watch.track(prefixes)
            return watch.wait_any(wanted, timeout)
        finally:
            self._release(watch)

    @property
    def tracking(self) -> bool:
        """Whether some thread's watch tracks published names (only then is :meth:`forget` needed)."""
        return self._tracking

    def forget(self, name: bytes) -> None:
        """This thread claimed ``name``: drop it from its watch's tracked set (no-op when not tracking)."""
        if not self._tracking:
            return  # no thread ever called wait_any: nothing is tracked (a get calls this every time)
        watch: _Watch | None = getattr(self._local, "watch", None)
        if watch is not None:
            watch.forget(name)

    def close(self) -> None:
        """Close every idle watch; a watch in use is closed by its waiter when its wait ends."""
        with self._lock:
            self._closed = True
            watches, self._watches = self._watches, []
            for w in watches:
                if not w.busy:
                    w.close()
