"""The producer's staged payloads: one :class:`Staged` per key, claimed by one consumer at a time.

A consumer *claims* a key (getting a token), reads the bytes with a one-sided
transfer, then *finishes* the claim, which frees the slab. A claim that is not
finished within ``claim_timeout`` lapses (the consumer died) and the payload is
available again; a payload nobody consumes within ``ttl`` is reclaimed. A slab
is never reused while a claim on it is live, so a reader never sees another
payload's bytes unless its claim lapsed, which ``finish`` then reports.

A fan-out stages one slab under several keys (:meth:`StagingTable.stage_many`):
each key is still claimed, finished, expired and discarded on its own, and the
slab goes back to the pool when the last of them is done with it (a
:class:`Shared` count). Everything here lives in the producer's process, so a
consumer that dies only lets its claim lapse; no count is left behind.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field

from omni_plugins_mooncake.memory import Slab, SlabPool


class Shared:
    """A slab staged under several keys: it goes back to the pool once every one of them released it.

    The count is a list of tokens popped one per release (``list.pop`` is
    atomic): the release that pops token 0 is the last. No lock, so a release
    from a lease's weakref callback can never wait for a lock its own thread
    holds.
    """

    __slots__ = ("_tokens",)

    def __init__(self, holders: int) -> None:
        self._tokens = list(range(holders))

    def release(self) -> bool:
        """One holder is done; True for the last one (the slab is free)."""
        return self._tokens.pop() == 0


@dataclass(eq=False)
class Staged:
    """One payload waiting in registered memory (``shared``: the slab is staged under other keys too)."""

    key: str
    slab: Slab
    nbytes: int
    expires_at: float
    token: int | None = None
    claim_deadline: float = 0.0
    superseded: bool = field(default=False)
    shared: Shared | None = None


class StagingTable:
    """Staged payloads by key and live claims by token. Thread-safe."""

    def __init__(self, pool: SlabPool, *, ttl: float, claim_timeout: float) -> None:
        self._pool = pool
        self.ttl = ttl
        self.claim_timeout = claim_timeout
        self._by_key: dict[str, Staged] = {}
        self._claims: dict[int, Staged] = {}
        self._lock = threading.Lock()
        # claim tokens: a counter from a random start, so a token is never handed out twice by
        # one table (a finish arriving after its claim lapsed matches no later claim), without
        # a getrandom call on every claim
        self._next_token = itertools.count(secrets.randbits(48) + 1).__next__
        self.reclaimed = 0

    def stage(self, key: str, slab: Slab, nbytes: int) -> None:
        """Publish ``slab`` (holding ``nbytes`` of payload) under ``key``, replacing an older payload."""
        self.stage_many([key], slab, nbytes)

    def stage_many(self, keys: list[str], slab: Slab, nbytes: int) -> None:
        """Publish one ``slab`` under every key of ``keys`` (each replacing an older payload); freed after the last."""
        expires = time.monotonic() + self.ttl
        shared = Shared(len(keys)) if len(keys) > 1 else None
        drops: list[Staged | None] = []
        with self._lock:
            for key in keys:
                old = self._by_key.pop(key, None)
                self._by_key[key] = Staged(key, slab, nbytes, expires, shared=shared)
                drops.append(self._detach(old))
        for drop in drops:
            self._free(drop)

    def claim(self, key: str) -> Staged | None:
        """Reserve ``key`` for one remote reader; None when absent or already being read."""
        now = time.monotonic()
        with self._lock:
            entry = self._by_key.get(key)
            if entry is None or entry.token is not None:
                return None
            entry.token = self._next_token()
            entry.claim_deadline = now + self.claim_timeout
            self._claims[entry.token] = entry
            return entry

    def finish(self, token: int) -> bool:
        """The reader is done: free the payload. False when the claim had lapsed (its bytes may be stale)."""
        with self._lock:
            entry = self._claims.pop(token, None)
            if entry is None:
                return False
            if self._by_key.get(entry.key) is entry:
                del self._by_key[entry.key]
        self.release(entry)
        return True

    def unclaim(self, token: int) -> None:
        """The reader failed: make the payload available again."""
        with self._lock:
            entry = self._claims.pop(token, None)
            if entry is None:
                return
            entry.token = None
            drop = entry if entry.superseded else None
        self._free(drop)

    def take(self, key: str) -> Staged | None:
        """Remove an unclaimed payload for a reader in this process; the caller now holds it (:meth:`release` when done)."""
        with self._lock:
            entry = self._by_key.get(key)
            if entry is None or entry.token is not None:
                return None
            del self._by_key[key]
            return entry

    def discard(self, key: str) -> bool:
        """Drop ``key`` (cleanup). A payload being read is freed when the read finishes."""
        with self._lock:
            old = self._by_key.pop(key, None)
            drop = self._detach(old)
        self._free(drop)
        return old is not None

    def reap(self) -> int:
        """Reclaim expired payloads and lapsed claims; returns how many payloads were freed."""
        now = time.monotonic()
        drops: list[Staged] = []
        with self._lock:
            for token, entry in list(self._claims.items()):
                if entry.claim_deadline <= now:
                    del self._claims[token]
                    entry.token = None
                    if entry.superseded:
                        drops.append(entry)
            for key, entry in list(self._by_key.items()):
                if entry.token is None and entry.expires_at <= now:
                    del self._by_key[key]
                    drops.append(entry)
            self.reclaimed += len(drops)
        for entry in drops:
            self.release(entry)
        return len(drops)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "staged": len(self._by_key),
                "staged_bytes": sum(e.nbytes for e in self._by_key.values()),
                "being_read": len(self._claims),
                "reclaimed_by_ttl": self.reclaimed,
            }

    def close(self) -> None:
        """Free everything (readers still in flight will see their claim lapse)."""
        with self._lock:
            entries = {id(e): e for e in [*self._by_key.values(), *self._claims.values()]}
            self._by_key.clear()
            self._claims.clear()
        for entry in entries.values():
            self.release(entry)

    def release(self, entry: Staged) -> None:
        """``entry`` is done (finished, dropped, or read in this process): its slab goes back unless other keys hold it."""
        if entry.shared is None or entry.shared.release():
            self._pool.release(entry.slab)

    # -- helpers ----------------------------------------------------------------
    def _detach(self, old: Staged | None) -> Staged | None:
        """Lock held: a removed entry is freed now, or at the end of its read when claimed."""
        if old is None:
            return None
        if old.token is not None:
            old.superseded = True
            return None
        return old

    def _free(self, entry: Staged | None) -> None:
        if entry is not None:
            self.release(entry)
