"""``mooncake-store``: payloads in a ``MooncakeDistributedStore``.

``put`` encodes the payload straight into a registered slab and hands it to the
store with ``upsert_from`` (``put`` would keep an old value); ``get`` reads with
``get_into`` into another registered slab and decodes zero-copy over it. The
consumed key is force-removed (a plain ``remove`` inside the lease fails with
-706) by a background :class:`~omni_plugins_mooncake._remover.Remover`, off the
reader's critical path; until then this connector treats the key as gone.

``put_many`` (a fan-out) encodes once: large payloads go to the new keys with
one ``batch_put_from_multi_buffers`` straight from the encoder's buffers, the
rest are copied into one slab once and stored under every key with one
``batch_upsert_from`` (the store copies the slab per key).

Data lives in the global segment of a client (the putter's, which this
connector prefers) and disappears when that client closes: a producer must
stay open until its payloads are consumed.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from omni_plugins import wire
from omni_plugins.backoff import poll
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult, failed_put
from omni_plugins.errors import ConnectorError
from omni_plugins_mooncake._direct import DIRECT_MIN, DirectPut
from omni_plugins_mooncake._env import prepare_environment
from omni_plugins_mooncake._import import import_mooncake
from omni_plugins_mooncake._remover import Remover
from omni_plugins_mooncake.config import MooncakeStoreConfig, parse_host_port
from omni_plugins_mooncake.errors import BUFFER_TOO_SMALL, LEASE_EXPIRED, OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, describe
from omni_plugins_mooncake.memory import Slab, SlabPool

logger = logging.getLogger(__name__)

_READ_ATTEMPTS = 3  # reads of one key that outlived the master's lease, at least, before a get gives up
#: codes of a read that found no payload (yet): absent, consumed or cleaned up in between, or its put is still
#: under way (the master knows the key from the put's start but serves it only once the put has ended)
_NOT_THERE_YET = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY})


def check_master_reachable(address: str, timeout: float) -> None:
    """Fail fast when nothing listens at the master's RPC port (``setup`` would block ~90 s)."""
    host, port = parse_host_port(address, what="master_address")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise ConnectorError(
            f"mooncake master at {address} is not reachable ({exc}); start it, e.g. mooncake_master --rpc_address={host} --rpc_port={port}"
        ) from exc


class MooncakeStoreConnector(Connector):
    """Connector over a Mooncake distributed store (master + client segments)."""

    capabilities = Capabilities(blocking_get=True, cross_process=True, cross_host=True, zero_copy_get=True, consume_on_get=True)
    config_model = MooncakeStoreConfig

    def __init__(self, config: MooncakeStoreConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or MooncakeStoreConfig()
        store_mod = import_mooncake("mooncake.store")
        check_master_reachable(cfg.master_address, cfg.connect_timeout)
        prepare_environment(cfg.local_hostname)
        store = store_mod.MooncakeDistributedStore()
        rc = store.setup(
            cfg.local_hostname,
            cfg.metadata_server,
            int(cfg.global_segment_size),
            int(cfg.local_buffer_size),
            cfg.protocol,
            cfg.device_name,
            cfg.master_address,
        )
        if rc != 0:
            raise ConnectorError(f"mooncake store setup against master {cfg.master_address} failed: {describe(rc)}")
        self._store = store
        self._replicate = store_mod.ReplicateConfig()
        if int(cfg.global_segment_size) > 0:
            # keep what this client puts in its own segment (the data is local until read)
            self._replicate.preferred_segment = store.get_hostname()
        self._pool = SlabPool(
            store.register_buffer,
            store.unregister_buffer,
            name=f"mooncake-store client of {cfg.master_address}",
            max_idle_bytes=int(cfg.max_idle_buffer_bytes),
        )
        self._direct = DirectPut(store, self._replicate)
        self._size_hint = 1  # bytes of the last payload read (racy by design: only a hint)
        self._stats_lock = threading.Lock()
        self._stats = {"puts": 0, "gets": 0, "bytes_put": 0, "bytes_got": 0, "remove_failures": 0, "direct_puts": 0}
        self._remover = Remover(
            lambda key: int(store.remove(key, True)),
            lambda keys: [int(c) for c in store.batch_remove(keys, True)],
            self._remove_failed,
            name=f"mooncake-store remover ({cfg.master_address})",
        )

    # -- contract ------------------------------------------------------------
    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        encoded = wire.encode(data)
        n = encoded.nbytes
        self._remover.settle(key)  # a late removal of the key's consumed predecessor must not delete this one
        rc = self._direct.put(key, encoded) if n >= DIRECT_MIN else None  # large and new: no staging copy
        direct = rc is not None
        if rc is None:
            slab = self._pool.acquire(n)
            try:
                encoded.write_into(slab.view(n))
                rc = self._store.upsert_from(key, slab.address, n, self._replicate)
            finally:
                self._pool.release(slab)
        if rc != 0:
            raise self._put_error(key, n, rc)
        with self._stats_lock:  # spelled out: no **kwargs dict on the hot path
            stats = self._stats
            stats["puts"] += 1
            stats["bytes_put"] += n
            stats["direct_puts"] += direct
        return PutResult(True, n, None)

    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        """Encode once; one batch call for the keys that take the direct path, one for the rest (see the module docstring)."""
        encoded = wire.encode(data)  # WireFormatError: nothing stored
        n = encoded.nbytes
        keys = [key for _, _, key in targets]
        for key in keys:
            self._remover.settle(key)  # a late removal of a consumed predecessor must not delete the new payload
        codes: list[int | None] = self._direct.put_many(keys, encoded) if n >= DIRECT_MIN else [None] * len(keys)
        direct = sum(c == 0 for c in codes)
        staged = [i for i, c in enumerate(codes) if c is None]
        failure: Exception | None = None
        if staged:
            try:
                slab = self._pool.acquire(n)
                try:
                    encoded.write_into(slab.view(n))
                    rcs = self._store.batch_upsert_from(
                        [keys[i] for i in staged], [slab.address] * len(staged), [n] * len(staged), self._replicate
                    )
                finally:
                    self._pool.release(slab)
                for i, rc in zip(staged, rcs, strict=True):
                    codes[i] = int(rc)
            except Exception as exc:  # e.g. no registered memory for the copy: those keys fail, the direct ones stand
                failure = exc
        results: list[PutResult] = []
        for key, rc in zip(keys, codes, strict=True):
            if rc is None:  # no code: the copy into a slab failed
                assert failure is not None
                results.append(failed_put(failure))
            else:
                results.append(PutResult(True, n, None) if rc == 0 else failed_put(self._put_error(key, n, rc)))
        stored = sum(r.ok for r in results)
        with self._stats_lock:
            stats = self._stats
            stats["puts"] += stored
            stats["bytes_put"] += n * stored
            stats["direct_puts"] += direct
        return results

    def _put_error(self, key: str, n: int, rc: int) -> ConnectorError:
        return ConnectorError(
            f"mooncake store (master {self.config.master_address}): put of key {key!r} ({n} bytes) failed: {describe(rc)}"
        )

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        if not timeout or timeout <= 0:  # one attempt: no closure, no poll frame (this path runs cold; the base checked open)
            return self._try_get(key)
        deadline = time.monotonic() + timeout
        return poll(lambda: self._try_get_open(key, deadline), timeout, self.config.poll_interval)

    def _try_get_open(self, key: str, deadline: float) -> GetResult | None:
        self._check_open()  # a polling get must notice a close from another thread
        return self._try_get(key, deadline)

    def _try_get(self, key: str, deadline: float = 0.0) -> GetResult | None:
        if self._remover.pending(key):  # consumed here; its removal is still under way
            return None
        # Read straight into a slab as large as the last payload: one RPC instead of
        # get_size + get_into. Only a larger payload pays a size lookup and a second read.
        slab = self._pool.acquire(self._size_hint)
        try:
            slab.clear_head()
            got = int(self._store.get_into(key, slab.address, slab.size))
            if got == LEASE_EXPIRED:
                got = self._read_into(key, slab, deadline)
            if got == BUFFER_TOO_SMALL:
                size = self._store.get_size(key)
                if size < 0:
                    got = size
                else:
                    self._pool.release(slab)
                    slab = self._pool.acquire(size)
                    got = self._read_into(key, slab, deadline)
        except BaseException:
            self._pool.release(slab)
            raise
        if got < 0:
            self._pool.release(slab)
            if got in _NOT_THERE_YET:
                return None
            raise ConnectorError(f"mooncake store (master {self.config.master_address}): read of key {key!r} failed: {describe(got)}")
        self._size_hint = got
        view = self._pool.lease(slab, got)  # the slab returns to the pool when the decoded tensors die
        self._remover.submit(key)
        try:
            data = wire.decode(view)
        finally:
            del view
        with self._stats_lock:
            stats = self._stats
            stats["gets"] += 1
            stats["bytes_got"] += got
        return GetResult(data, got)

    def _read_into(self, key: str, slab: Slab, deadline: float) -> int:
        """``get_into`` that retries a read which outlived the master's lease (the object is still there).

        A slow or lossy network can make every read of a large payload outlive a short
        lease: the read is retried :data:`_READ_ATTEMPTS` times, and on until the get's
        ``deadline`` (``time.monotonic()``) when it has one, before the get fails.
        """
        attempts = 0
        while True:
            slab.clear_head()
            got = int(self._store.get_into(key, slab.address, slab.size))
            attempts += 1
            if got != LEASE_EXPIRED or (attempts >= _READ_ATTEMPTS and time.monotonic() >= deadline):
                return got
            logger.info("mooncake store: read of key %r outlived its lease; retrying", key)

    def _cleanup(self, key: str) -> bool:
        if self._remover.settle(key):
            return False  # already consumed
        rc = self._store.remove(key, True)
        if rc == 0:
            return True
        if rc == OBJECT_NOT_FOUND:
            return False
        raise ConnectorError(f"mooncake store (master {self.config.master_address}): remove of key {key!r} failed: {describe(rc)}")

    def _health(self) -> dict[str, Any]:
        rc = self._store.health_check()
        with self._stats_lock:
            stats = dict(self._stats)
        return {
            "ok": rc == 0,
            "master": self.config.master_address,
            "segment": self._store.get_hostname(),
            "store_status": {0: "healthy", 1: "not initialised", 2: "master unreachable"}.get(rc, f"code {rc}"),
            "buffers": self._pool.stats(),
            "pending_removals": len(self._remover),
            **stats,
        }

    def _close(self) -> None:
        self._remover.close(timeout=10.0)  # consumed objects are removed before the client goes (bounded: master may be down)
        self._pool.close()
        rc = self._store.close()
        if rc != 0:
            logger.warning("closing mooncake store client of master %s returned %s", self.config.master_address, describe(rc))

    # -- helpers -------------------------------------------------------------
    def _remove_failed(self, key: str, rc: int) -> None:
        if rc == OBJECT_NOT_FOUND:  # cleaned up (or the master restarted) in between
            return
        self._count(remove_failures=1)
        logger.warning(
            "mooncake store (master %s): consumed key %r could not be removed: %s", self.config.master_address, key, describe(rc)
        )

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._stats[name] += delta
