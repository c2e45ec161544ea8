"""File primitives on a tmpfs directory: create 0600, map, publish without replacing, quiet unlink."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os

PAGE = mmap.PAGESIZE
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1

try:
    from omni_plugins_shm._native import rename_noreplace as _native_rename
except ImportError:  # pragma: no cover - pure-Python install
    _native_rename = None

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int


def round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def create_segment(path: str, size: int) -> mmap.mmap:
    """Create ``path`` (O_EXCL, mode 0600), reserve ``size`` bytes of tmpfs and map it read-write.

    The space is reserved with ``posix_fallocate`` so a full ``/dev/shm`` is an
    ``OSError(ENOSPC)`` here instead of a SIGBUS later while writing the mapping.
    The file is unlinked again if anything fails.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # independent of the umask
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        unlink_quiet(path)
        raise
    os.close(fd)
    return mm


def map_segment(fd: int, size: int) -> mmap.mmap:
    """Map an existing segment read-write (the consumer writes the state hint when it returns a pooled segment)."""
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


def close_quiet(mm: mmap.mmap) -> None:
    """Close a mapping unless views still export it (then it is unmapped when the last view dies)."""
    try:
        mm.close()
    except BufferError:
        pass
