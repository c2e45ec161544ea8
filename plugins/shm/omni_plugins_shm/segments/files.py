"""File primitives on a tmpfs directory: create 0600, map, publish without replacing, quiet unlink.

Mappings hold no file descriptor where that can be had. ``mmap.mmap`` keeps a ``dup`` of the
descriptor for the mapping's whole life (Python 3.13 added ``trackfd=False`` to say no), and
the kernel needs none: a mapping keeps its file alive by itself. A producer maps every segment
of its pool and a consumer every segment it caches or lends out, so with one descriptor each a
consumer that falls far behind (thousands of pooled segments) runs into ``RLIMIT_NOFILE``
(1024 by default) -- its own opens fail with ``EMFILE``, and so do the application's. So
:func:`map_file` maps through the C extension's ``map_shared`` (a mapping object of its own with
the same buffer and ``close()`` behaviour as ``mmap.mmap``), else ``trackfd=False`` (3.13+), else
``mmap.mmap`` as it is (one descriptor per mapping: :data:`MAPPING_HOLDS_FD`); the caller closes
its own descriptor right after mapping either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
from typing import Protocol

PAGE = mmap.PAGESIZE
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1

try:
    from omni_plugins_shm._native import rename_noreplace as _native_rename
except ImportError:  # pragma: no cover - pure-Python install
    _native_rename = None
try:
    from omni_plugins_shm._native import map_shared as _native_map
except ImportError:  # pragma: no cover - pure-Python install, or an extension built before map_shared
    _native_map = None

#: every mapping keeps a file descriptor open while it lives (no C extension, Python before 3.13)
MAPPING_HOLDS_FD = _native_map is None and sys.version_info < (3, 13)


class MappedFile(Protocol):
    """A shared mapping of a segment: ``mmap.mmap`` or the C extension's ``SharedMap`` (buffer, ``len``, ``close``)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def create_segment(path: str, size: int) -> MappedFile:
    """Create ``path`` (O_EXCL, mode 0600), reserve ``size`` bytes of tmpfs and map it read-write.

    The space is reserved with ``posix_fallocate`` so a full ``/dev/shm`` is an
    ``OSError(ENOSPC)`` here instead of a SIGBUS later while writing the mapping.
    The file is unlinked again if anything fails.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # independent of the umask
        os.posix_fallocate(fd, 0, size)
        mm = map_file(fd, size)
    except BaseException:
        os.close(fd)
        unlink_quiet(path)
        raise
    os.close(fd)
    return mm


def map_file(fd: int, size: int) -> MappedFile:
    """Map ``size`` bytes of the file open at ``fd`` shared and read-write, holding no descriptor where possible.

    Read-write also for consumers: they write the state hint when they return a pooled segment.
    The caller closes ``fd`` afterwards (the mapping does not need it).
    """
    if _native_map is not None:
        mapped: MappedFile = _native_map(fd, size)
        return mapped
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, trackfd=False)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically rename ``src`` to ``dst``; ``FileExistsError`` if ``dst`` exists (never overwrites)."""
    if _native_rename is not None:
        try:
            _native_rename(src, dst)  # the C extension: ~10 us less than the ctypes call below
            return
        except NotImplementedError:
            pass
    elif _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), src, None, dst)
    # fallback: link is atomic and fails on an existing target
    os.link(src, dst)
    os.unlink(src)


def unlink_quiet(path: str) -> bool:
    """Unlink ``path``; False if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def close_quiet(mm: MappedFile) -> None:
    """Close a mapping unless views still export it (then it is unmapped when the last view dies)."""
    try:
        mm.close()
    except BufferError:
        pass
