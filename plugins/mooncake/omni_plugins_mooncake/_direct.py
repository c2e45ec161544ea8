"""Store puts straight from the caller's memory: no staging copy for large payloads.

``upsert_from`` needs the whole payload in one registered buffer, so the store
connector's ordinary ``put`` copies the encoded payload into a slab first (the
staging copy) and Mooncake then copies the slab into the segment. For a large
payload that first copy is most of what separates ``put`` from a raw
``put_from``. :class:`DirectPut` registers the encoded parts where they are
(header, tensor bytes, padding; about 7 µs per registration over TCP) and hands
them to ``batch_put_from_multi_buffers``, which writes them in order as one
object: one copy, like the raw call. Mooncake copies during the call, so the
caller may change its tensors as soon as ``put`` returns, as with the slab path.

That call is a plain put: on an existing key it keeps the old value and still
returns 0. So it is used only for a key the master does not have (``is_exist``
first, one small RPC); an existing key, too many parts, or memory that cannot be
registered (e.g. overlapping views) take the slab path and ``upsert_from``. A
writer that creates the key between the two calls wins, a valid order for two
concurrent puts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_plugins.wire import Encoded

DIRECT_MIN = 4 << 20  # smaller payloads: the copy costs about what the extra lookup does
MAX_PARTS = 32  # each part is one registration


class Registrations:
    """Reference-counted registrations of caller memory (two puts may share a tensor). Thread-safe."""

    def __init__(self, register: Callable[[int, int], int], unregister: Callable[[int], int]) -> None:
        self._register = register
        self._unregister = unregister
        self._counts: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def acquire(self, ranges: list[tuple[int, int]]) -> bool:
        """Register every ``(address, size)``; on any failure undo and return False."""
        done: list[tuple[int, int]] = []
        with self._lock:
            for rng in ranges:
                count = self._counts.get(rng, 0)
                if count == 0 and self._register(*rng) != 0:
                    self._release_locked(done)
                    return False
                self._counts[rng] = count + 1
                done.append(rng)
        return True

    def release(self, ranges: list[tuple[int, int]]) -> None:
        with self._lock:
            self._release_locked(ranges)

    def __len__(self) -> int:
        return len(self._counts)

    def _release_locked(self, ranges: list[tuple[int, int]]) -> None:
        for rng in ranges:
            count = self._counts[rng] - 1
            if count:
                self._counts[rng] = count
            else:
                del self._counts[rng]
                self._unregister(rng[0])


class DirectPut:
    """``put(key, encoded)``: the store's return code, or None when the slab path must be used."""

    def __init__(self, store: Any, replicate: Any) -> None:
        self._store = store
        self._replicate = replicate
        self.registrations = Registrations(store.register_buffer, store.unregister_buffer)

    def put(self, key: str, encoded: Encoded) -> int | None:
        return self.put_many([key], encoded)[0]

    def put_many(self, keys: list[str], encoded: Encoded) -> list[int | None]:
        """One payload under several keys: per key the store's return code, or None where the slab path must be used.

        One existence lookup for all keys and one batch put for the new ones, all from the same registered parts.
        """
        parts = [np.frombuffer(b, dtype=np.uint8) for b in encoded.buffers() if b.nbytes]
        if not parts or len(parts) > MAX_PARTS:
            return [None] * len(keys)
        exist = [int(c) for c in self._store.batch_is_exist(keys)] if len(keys) > 1 else [int(self._store.is_exist(keys[0]))]
        new = [key for key, found in zip(keys, exist, strict=True) if found == 0]  # exists (1) or failed (< 0): the slab path
        if not new:
            return [None] * len(keys)
        ranges = [(int(a.ctypes.data), int(a.nbytes)) for a in parts]
        if not self.registrations.acquire(sorted(set(ranges))):
            return [None] * len(keys)
        try:
            ptrs, sizes = [a for a, _ in ranges], [n for _, n in ranges]
            codes = self._store.batch_put_from_multi_buffers(new, [ptrs] * len(new), [sizes] * len(new), self._replicate)
        finally:
            self.registrations.release(sorted(set(ranges)))
            del parts
        by_key = dict(zip(new, (int(c) for c in codes), strict=True))
        return [by_key.get(key) for key in keys]
