"""Running short of a resource is not a bad segment.

A consumer at its descriptor limit cannot ``open`` a claimed segment (``EMFILE``), one out of
address space or mappings cannot ``mmap`` it (``ENOMEM``): the segment is fine and the same get
can succeed once the process has let go of something. So these errors are never judged as
corruption (which removes the segment) nor as a dead process (which lets gc remove its
segments); a get that meets one publishes the segment again and raises
:class:`~omni_plugins.errors.TransientConnectorError` with :func:`shortage_error`'s message,
which the runtime retries.
"""

from __future__ import annotations

import errno
import resource

from omni_plugins.errors import TransientConnectorError

#: errnos of running short of a resource of this process or machine: descriptors (EMFILE, ENFILE), memory,
#: address space or mappings (ENOMEM; EAGAIN: locked memory), room in the tmpfs (ENOSPC, when creating)
SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.ENOSPC})
_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def is_shortage(exc: BaseException) -> bool:
    """``exc`` says this process (or machine) ran short of descriptors, memory or room -- not that a file is bad."""
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in SHORTAGE_ERRNOS)


def is_descriptor_shortage(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _DESCRIPTORS


def descriptor_limits() -> tuple[int, int]:
    """``(soft, hard)`` RLIMIT_NOFILE of this process (``resource.RLIM_INFINITY`` where unlimited)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _limit(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)


def _max_map_count() -> str:
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def advice(exc: BaseException) -> str:
    """Which resource ``exc`` ran short of and how to get more of it (no system call that needs a descriptor for EMFILE)."""
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        soft, hard = descriptor_limits()
        if soft != hard:
            how = f"raise it where the process starts (ulimit -n {_limit(hard)}: up to the hard limit)"
        else:
            how = "raise the hard limit where the process starts (limits.conf, LimitNOFILE= in a systemd unit, docker run --ulimit nofile=)"
        return f"this process has used up its open-file limit (RLIMIT_NOFILE soft {_limit(soft)}, hard {_limit(hard)}); {how}, or hold fewer files open"
    if isinstance(exc, OSError) and exc.errno == errno.ENFILE:
        return "the machine has used up its open-file table (fs.file-max); raise it with sysctl or close files elsewhere"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "the shm directory is full; let consumers catch up, or give the tmpfs more room (docker --shm-size)"
    return (
        "this process ran out of memory, address space or mappings (vm.max_map_count "
        f"{_max_map_count()}); hold fewer zero-copy results at once, or raise vm.max_map_count"
    )


def shortage_error(what: str, exc: BaseException) -> TransientConnectorError:
    """The retryable error for ``what`` (e.g. "shm get of key 'k' ...: cannot open its segment") that ran short."""
    why = str(exc) if isinstance(exc, OSError) else type(exc).__name__
    return TransientConnectorError(f"{what}: {why}: {advice(exc)}")
