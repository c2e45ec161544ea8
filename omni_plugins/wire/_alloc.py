"""Owned output memory for ``decode(copy=True)``.

For large buffers the cost of a copy into fresh memory is dominated by page faults
(one per 4 KiB page: copying into fresh memory is several times slower than into pre-touched memory).
glibc serves allocations up to its dynamic mmap threshold (at most 32 MiB) from the heap,
whose pages are reused already faulted, so ``numpy.empty`` is the right choice below
:data:`HUGE_THRESHOLD`. Above it every ``malloc`` is a fresh ``mmap`` that faults page by
page; those buffers are placed instead in a private anonymous mapping advised
``MADV_HUGEPAGE`` (transparent huge pages are in ``madvise`` mode on the target
machines), which takes one fault per 2 MiB. The mapping is released when the last array /
tensor over it is garbage collected. Platforms without ``madvise`` use ``numpy.empty``.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
HUGE_THRESHOLD = 32 << 20
_CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def empty_bytes(nbytes: int) -> np.ndarray:
    """A writable, uninitialised uint8 array of ``nbytes`` owned by the caller."""
    if nbytes < HUGE_THRESHOLD or not _CAN_ADVISE:
        return np.empty(nbytes, dtype=np.uint8)
    try:
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:  # pragma: no cover - kernel without THP / mmap limits
        logger.debug("huge-page allocation of %d bytes failed (%s); using numpy.empty", nbytes, exc)
        return np.empty(nbytes, dtype=np.uint8)
    whole = np.frombuffer(m, dtype=np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE  # start on a 2 MiB boundary so every page can be huge
    return whole[skip : skip + nbytes]


def copy_out(src: np.ndarray) -> np.ndarray:
    """An owned, C-contiguous copy of ``src`` (same dtype and shape)."""
    if src.nbytes < HUGE_THRESHOLD:
        return src.copy()
    out = empty_bytes(src.nbytes).view(src.dtype).reshape(src.shape)
    np.copyto(out, src)
    return out
