"""Registered memory, reused: slabs of anonymous memory and a pool that lends them out.

Mooncake moves bytes only between *registered* ranges, and registering is not
free (with RDMA it pins pages), so slabs are registered once and reused. A
slab lent to a ``get`` caller stays out of the pool while any tensor decoded
over it is alive: :meth:`SlabPool.lease` returns a view whose exporter, when
garbage collected, puts the slab back. That is how ``get`` hands out
zero-copy tensors without the next transfer overwriting them.
"""

from __future__ import annotations

import logging
import mmap
import threading
import weakref
from collections.abc import Callable

import numpy as np

from omni_plugins.errors import ConnectorError

logger = logging.getLogger(__name__)

Register = Callable[[int, int], int]
Unregister = Callable[[int], int]

_PAGE = mmap.PAGESIZE


def size_class(nbytes: int, minimum: int) -> int:
    """Round up to a quarter step of a power of two (waste <= 25%), pages included."""
    n = max(nbytes, minimum, 1)
    top = 1 << (n - 1).bit_length()
    step = max(top // 8, _PAGE)
    return -(-n // step) * step


def _refuse_register(address: int, size: int) -> int:
    return -1


def _ignore_unregister(address: int) -> int:
    return 0


class Slab:
    """One page-aligned anonymous mapping registered with a Mooncake engine or store client."""

    __slots__ = ("__weakref__", "_array", "_mmap", "address", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address: int = int(self._array.ctypes.data)

    def clear_head(self) -> None:
        """Zero the first bytes (a message's magic) before a read into this slab.

        A reused slab still holds the message read into it last: a read that reports a
        length but leaves the slab untouched would otherwise decode as that old,
        well-formed message. With the magic zeroed it fails the decoder's first check.
        """
        self._array[:16] = 0

    def view(self, nbytes: int) -> memoryview:
        """A writable view of the first ``nbytes`` (valid only while the slab is held)."""
        return self._array[:nbytes].data

    def exporter(self, nbytes: int) -> np.ndarray:
        """A fresh array object over the first ``nbytes``; every view derived from it keeps it alive."""
        return self._array[:nbytes]


class SlabPool:
    """Slabs by size class, registered through ``register``/``unregister`` (the engine's or store's).

    ``max_total_bytes`` caps slabs that exist at once (idle ones are freed first
    to make room); ``None`` means no cap. At most ``max_idle_bytes`` are kept
    idle for reuse. Thread-safe.
    """

    def __init__(
        self,
        register: Register,
        unregister: Unregister,
        *,
        name: str,
        max_idle_bytes: int,
        max_total_bytes: int | None = None,
        min_slab: int = 1 << 20,
    ) -> None:
        self._register = register
        self._unregister = unregister
        self.name = name
        self.max_idle_bytes = max_idle_bytes
        self.max_total_bytes = max_total_bytes
        self.min_slab = min_slab
        self._idle: dict[int, list[Slab]] = {}
        self._idle_bytes = 0
        self._total_bytes = 0
        self._lock = threading.RLock()  # a finalizer may release a slab while the lock is held (gc)
        self._closed = False
        # leased slabs with the weak reference that watches their exporter, by id of that
        # reference (arrays are unhashable; the reference must outlive the exporter for its
        # callback to run, so the pool holds it)
        self._leases: dict[int, tuple[weakref.ref[np.ndarray], Slab, Callable[[], None] | None]] = {}

    # -- lending -------------------------------------------------------------
    def acquire(self, nbytes: int) -> Slab:
        """A registered slab of at least ``nbytes``; give it back with :meth:`release` or :meth:`lease`."""
        size = size_class(nbytes, self.min_slab)
        with self._lock:
            if self._closed:
                raise ConnectorError(f"{self.name}: buffer pool is closed")
            bucket = self._idle.get(size)
            if bucket:
                self._idle_bytes -= size
                return bucket.pop()
            victims = self._make_room(size)
            if self.max_total_bytes is not None and self._total_bytes + size > self.max_total_bytes:
                in_use = self._total_bytes - self._idle_bytes
                self._free_all(victims)
                raise ConnectorError(
                    f"{self.name}: registered memory exhausted: need {size} bytes, {in_use} of "
                    f"{self.max_total_bytes} in use by unconsumed payloads (raise pool_size or consume faster)"
                )
            self._total_bytes += size
        self._free_all(victims)
        try:
            slab = Slab(size)
            rc = self._register(slab.address, size)
        except Exception:
            self._forget(size)
            raise
        if rc != 0:
            self._forget(size)
            raise ConnectorError(f"{self.name}: registering {size} bytes of memory failed (code {rc})")
        return slab

    def release(self, slab: Slab) -> None:
        """Give a slab back; it is kept for reuse or freed when the idle budget is full."""
        with self._lock:
            if not self._closed and self._idle_bytes + slab.size <= self.max_idle_bytes:
                self._idle.setdefault(slab.size, []).append(slab)
                self._idle_bytes += slab.size
                return
            closed = self._closed
            self._total_bytes -= slab.size
        if not closed:  # after close the engine is gone: just drop the memory
            self._free(slab)

    def lease(self, slab: Slab, nbytes: int, on_end: Callable[[], None] | None = None) -> memoryview:
        """A view of ``slab``'s first ``nbytes`` that releases the slab when it and all views/tensors over it die.

        ``on_end``: call this instead of releasing the slab (its holder decides, e.g. a slab staged under other keys too).
        """
        exporter = slab.exporter(nbytes)
        # A bare weakref with a callback, not weakref.finalize: this runs right after a
        # transfer, when caches are cold, and finalize's Python bookkeeping cost 30-50 us
        # there against a few for this.
        ref = weakref.ref(exporter, self._lease_ended)
        self._leases[id(ref)] = (ref, slab, on_end)
        return exporter.data  # a memoryview whose exporter is `exporter`

    def _lease_ended(self, ref: weakref.ref[np.ndarray]) -> None:
        lease = self._leases.pop(id(ref), None)
        if lease is None:
            return
        if lease[2] is not None:
            lease[2]()
        else:
            self.release(lease[1])

    # -- accounting ----------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"total_bytes": self._total_bytes, "idle_bytes": self._idle_bytes, "in_use_bytes": self._total_bytes - self._idle_bytes}

    def close(self) -> None:
        """Unregister and free idle slabs; slabs still lent out are dropped when returned."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            victims = [s for bucket in self._idle.values() for s in bucket]
            self._idle.clear()
            self._total_bytes -= self._idle_bytes
            self._idle_bytes = 0
        for slab in victims:
            self._free(slab)
        # drop the bound methods so the engine/store can be destroyed while leases are still out
        self._register = _refuse_register
        self._unregister = _ignore_unregister

    # -- internals (lock held where noted) --------------------------------------
    def _make_room(self, size: int) -> list[Slab]:
        """Lock held: pick idle slabs of other sizes to free until ``size`` more fits the caps."""
        victims: list[Slab] = []
        cap = self.max_total_bytes
        for bucket_size in sorted(self._idle, reverse=True):
            bucket = self._idle[bucket_size]
            while bucket and ((cap is not None and self._total_bytes + size > cap) or self._idle_bytes > self.max_idle_bytes):
                victims.append(bucket.pop())
                self._idle_bytes -= bucket_size
                self._total_bytes -= bucket_size
        return victims

    def _free_all(self, slabs: list[Slab]) -> None:
        for slab in slabs:
            self._free(slab)

    def _free(self, slab: Slab) -> None:
        rc = self._unregister(slab.address)
        if rc != 0:
            logger.warning("%s: unregistering %d bytes at %#x failed (code %d)", self.name, slab.size, slab.address, rc)

    def _forget(self, size: int) -> None:
        with self._lock:
            self._total_bytes -= size
