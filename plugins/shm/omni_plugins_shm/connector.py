"""``ShmConnector``: key-addressed payloads in POSIX shared memory, no server.

Life of one payload (every state change is an atomic ``rename`` in the shm directory):

1. ``put``: take a free segment from the producer's pool (``f. -> w.``) or create one,
   write header + :mod:`omni_plugins.wire` encoding straight into the mapping (one copy),
   publish it under the key's name (``w. -> k.<key>``, never replacing).
2. ``get``: claim by renaming ``k.<key> -> c.<me>.<n>`` (only one consumer can win), check the
   header, copy the payload into private memory (or hand out zero-copy views), then return the
   segment to its owner (``c. -> f.``) or unlink it (dedicated segments, owner gone).

``put_many`` (a fan-out): a payload the slot table holds is put per key (the
compiled encoder writes straight into each slot: encoding is the copy); a
larger one is encoded once into one segment published under every key (a hard
link per key, see :mod:`.segments.shared`).

Nothing travels from ``put`` to ``get`` but the key. See ``docs/backends/shm.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import stat
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, cast

import numpy as np

from omni_plugins import wire
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult, failed_put
from omni_plugins.errors import ConfigError, ConnectorError, CorruptPayloadError, TransientConnectorError, WireFormatError
from omni_plugins_shm import gc, modes, pubdir, shortage, wakeslots
from omni_plugins_shm.config import ShmConfig
from omni_plugins_shm.exitclose import close_at_exit
from omni_plugins_shm.expire import Expiry, Publication, free_claimed, reclaim
from omni_plugins_shm.naming import HASHED, PUBLISHED, WAKE_ANY_SLOT, KeyNames, Names, parse_name
from omni_plugins_shm.notify import Notifier
from omni_plugins_shm.proc import CurrentPid, Owner
from omni_plugins_shm.segments import shared
from omni_plugins_shm.segments.files import MAPPING_HOLDS_FD, rename_noreplace, unlink_quiet
from omni_plugins_shm.segments.header import CLOSED_OFFSET, HEADER_SIZE, PAYLOAD_OFFSET, STATE_FREE, STATE_OFFSET, Header, HeaderError
from omni_plugins_shm.segments.mapcache import MapCache, Mapping, descriptor_cap
from omni_plugins_shm.segments.pool import ProducerPool, Segment
from omni_plugins_shm.segments.private import PrivateBuffers, copy_into
from omni_plugins_shm.slots import DEFERRED, FILES, SEQ_MASK, TIMED_OUT, TOO_BIG, Lent, SlotClass, SlotTable
from omni_plugins_shm.wakeslots import SLICE

log = logging.getLogger(__name__)

# The hot paths build their results without the NamedTuples' Python-level __new__ (a frame each, per operation).
_put_ok = functools.partial(tuple.__new__, PutResult)
_got = functools.partial(tuple.__new__, GetResult)

#: ``_get_slots``'s "no look made yet" (its caller may hand in the result of a first ``take``)
_LOOK = object()
#: owned copies at least this large go to recycled (huge-page) private mappings; smaller ones to a bytearray
_PRIVATE_MIN = 256 << 10
_PUT_RETRIES = 4
#: longest busy-poll of one ``poll_any`` call (a caller wanting longer waits with ``wait_any``)
SPIN_MAX_S = 0.02
#: keys whose derived names are remembered before the cache starts over
_NAME_CACHE_MAX = 4096


class ShmConnector(Connector):
    """Shared-memory connector for processes on one machine (``shm`` / ``SharedMemoryConnector``)."""

    capabilities = Capabilities(
        blocking_get=True,
        cross_process=True,
        cross_host=False,
        zero_copy_get=True,
        consume_on_get=True,
        wait_any=True,
        interrupt_wait=True,  # off per instance without the slot table (see __init__)
        poll_any=True,  # likewise
        wait_any_sets=True,
    )
    config_model = ShmConfig

    def __init__(self, config: ShmConfig | None = None) -> None:
        super().__init__()
        self.config = config or ShmConfig()
        self._dir = self.config.shm_dir.rstrip("/") or "/"
        if not os.path.isdir(self._dir):
            raise ConfigError(f"shm connector: shm_dir {self._dir!r} is not a directory")
        self._names = Names(self.config.namespace)
        self._owner = Owner.new()
        self._pid = self._owner.pid  # the creating process: the hot paths compare CurrentPid.value with it
        self._token = self._owner.token
        self._views = self.config.zero_copy
        if self.config.reclaim_on_start:
            report = gc.collect(self.config.namespace, shm_dir=self._dir)
            if report.removed:
                log.info(
                    "shm namespace %r: reclaimed %d segments (%d bytes) of dead producers",
                    self.config.namespace,
                    len(report.removed),
                    report.bytes_freed,
                )
        self._pubdir = self._path(self._names.publish_dir)
        self._marker = pubdir.create_marker(self._pubdir, self._names.marker(self._token))
        wake: wakeslots.WakeFile | None = None
        table: SlotTable | None = None
        try:
            wake = wakeslots.WakeFile.open(self._pubdir, self._names.wake(), pubdir.ensure, self.config.futex_wait)
            table = self._open_slots(wake) if self.config.slot_count > 0 and wake.futex_waits else None
            self._check_mode(table is not None, wake)
            self._slots: SlotTable | None = table
        except BaseException:
            if table is not None:
                table.close()
            if wake is not None:
                wake.close()
            unlink_quiet(self._marker)
            pubdir.remove_if_empty(self._pubdir)
            raise
        self._wake = wake
        self._ring = wake.ring
        self._interrupted = False  # interrupt_wait() pending: the (next) wait_any of this instance returns
        if self._slots is None:  # interrupt_wait and poll_any need the futex words of the slot table's wait_any
            self.capabilities = dataclasses.replace(type(self).capabilities, interrupt_wait=False, poll_any=False)
        self._retired: list[SlotTable] = []  # tables gc --all removed under us (see _current_slots)
        self._reopen_lock = threading.Lock()
        self._pool = ProducerPool(
            self._dir, self._names, self._token, pool_bytes=self.config.pool_bytes, max_segment=self.config.pool_max_segment_bytes
        )
        self._maps = MapCache(self.config.map_cache_bytes, descriptor_cap())
        self._private = PrivateBuffers(self.config.recycle_bytes, self.config.hugepage_copies)
        self._notifier = Notifier(self._pubdir)
        self._published_prefixes = tuple(f"{self._names.prefix}{kind}.".encode() for kind in (PUBLISHED, HASHED))
        self._keys: dict[str, KeyNames] = {}
        self._last_wanted: tuple[tuple[str, ...], dict[bytes, str]] | None = None
        self._claim_prefix = self._path(self._names.claimed(self._token, 0))[:-1]
        self._claim_numbers = itertools.count()
        ttl = self.config.ttl_seconds
        self._expiry = Expiry(ttl, self._reclaim_expired) if ttl > 0 else None
        close_at_exit(self)  # a close from __del__ during interpreter teardown would find this plugin's modules gone

    def _check_mode(self, with_table: bool, wake: wakeslots.WakeFile) -> None:
        """Declare this instance's hand-off mode in its marker; ConfigError if a live instance of the namespace uses the other."""
        mode = modes.TABLE if with_table else modes.FILES
        modes.declare(self._marker, mode)
        pids = modes.others(self._pubdir, self._names, self._marker, mode)
        if not pids:
            return
        why = (
            f"slot_count={self.config.slot_count}, futex_wait={self.config.futex_wait}"
            + ("" if wake.futex_waits or not self.config.futex_wait else ", C extension omni_plugins_shm._native not built")
        )
        raise ConfigError(
            f"shm namespace {self.config.namespace!r}: this instance {'uses' if with_table else 'does not use'} the slot table "
            f"({why}) but live instance(s) in process(es) {sorted(set(pids))} {'do not' if with_table else 'do'}; small payloads "
            "put by one kind would be invisible to the other. Give every instance of a namespace the same slot_count and "
            "futex_wait (the defaults everywhere are fine)"
        )

    def _open_slots(self, wake: wakeslots.WakeFile) -> SlotTable:
        """Open (or create) the namespace's slot table with this instance's geometry (ringing ``wake``)."""
        cfg = self.config
        classes = [SlotClass(cfg.slot_count, cfg.slot_bytes), *(SlotClass(n, size) for n, size in cfg.slot_classes)]
        return SlotTable.open(self._pubdir, self._names.slots(), self._owner, classes, cfg.slot_idle_seconds, pubdir.ensure, wake.mm)

    def _path(self, name: str) -> str:
        return f"{self._dir}/{name}"  # os.path.join costs ~3 us and is called several times per op

    def _check_process(self) -> None:
        if CurrentPid.value != self._owner.pid:
            raise ConnectorError(
                f"shm connector (namespace {self.config.namespace!r}) was created in process {self._owner.pid} "
                f"and used in {os.getpid()} after fork; create one connector per process"
            )

    # -- put ----------------------------------------------------------------------------
    def put(self, from_stage: Any, to_stage: Any, key: str, data: Any) -> PutResult:
        """:meth:`Connector.put`; with the slot table the hot path is one C call and no further frame.

        The checks ``Connector.put`` and ``_put`` make (open, same process, no ttl due) are the
        condition here; anything else takes the general path.
        """
        slots = self._slots
        if slots is None or self._closed or self._expiry is not None or CurrentPid.value != self._pid:
            return super().put(from_stage, to_stage, key, data)
        return self._put_slots(slots, key, data, None)

    def put_many(self, targets: Sequence[tuple[Any, Any, str]], data: Any) -> list[PutResult]:
        """:meth:`Connector.put_many`; with the slot table a payload a slot holds costs one C call per key, as ``put``.

        Anything else (a payload larger than any slot, a full class, ``ttl_seconds``) takes :meth:`_put_many` from
        the first key the table did not take.
        """
        slots = self._slots
        encoder = wire.native_c_api()
        if (
            slots is None
            or encoder is None
            or self._closed
            or self._expiry is not None
            or CurrentPid.value != self._pid
            or not self._put_many_current  # a subclass that overrides put or _put gets every put through it
        ):
            return super().put_many(targets, data)
        results: list[PutResult] = []
        try:
            for _, _, key in targets:
                got = slots.put_obj(key, encoder, data)
                if got < 0:
                    break
                results.append(_put_ok((True, got, None)))
            else:
                return results
        except Exception:  # a damaged table, a payload the encoder refuses: the general path says which
            pass
        if not results:
            return super().put_many(targets, data)
        rest = [(str(f), str(t), k) for f, t, k in targets[len(results) :]]
        try:
            return results + self._put_many(rest, data)
        except Exception as exc:  # the first of the rest failed before anything of it was stored
            return results + [failed_put(exc)] * len(rest)

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        expiry = self._prepare_put()
        slots = self._slots
        if slots is None:
            return self._put_file(key, wire.encode(data), expiry, None)
        return self._put_slots(slots, key, data, expiry)

    def _prepare_put(self) -> Expiry | None:
        """What every put checks first: the process (no use after fork); ``ttl_seconds`` expiry when due."""
        if CurrentPid.value != self._pid:
            self._check_process()
        expiry = self._expiry
        if expiry is not None and expiry.due():
            self._expire(expiry)
        return expiry

    def _put_slots(self, slots: SlotTable, key: str, data: Any, expiry: Expiry | None) -> PutResult:
        """A put with the slot table: one C call (reserve, encode straight into the slot, replace, publish,
        ring), else :meth:`_put_declined`. A damaged table is a :class:`ConnectorError` naming the cure."""
        encoder = wire.native_c_api()
        try:
            got = slots.put_obj(key, encoder, data) if encoder is not None else DEFERRED
            if got >= 0:
                return _put_ok((True, got, None))
            return self._put_declined(slots, key, data, got, expiry)
        except WireFormatError:
            raise
        except ValueError as exc:  # the C table refuses a damaged mapping (its header checks)
            raise self._damaged(key, exc) from exc

    def _damaged(self, key: str, exc: ValueError) -> ConnectorError:
        return ConnectorError(
            f"shm put of key {key!r}: the slot table of namespace {self.config.namespace!r} in {self._pubdir} is damaged ({exc}); "
            f"stop its instances and run 'omni-plugins shm gc --namespace {self.config.namespace}'"
        )

    # -- put_many -------------------------------------------------------------------------
    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        """One payload under several keys (see the module docstring); a result per target."""
        expiry = self._prepare_put()
        slots = self._slots
        if slots is None:
            return self._put_many_files(targets, wire.encode(data), expiry, None)
        encoder = wire.native_c_api()
        results: list[PutResult] = []
        for _, _, key in targets:  # small enough for a slot: a put per key, each encoding straight into its slot
            try:
                got = slots.put_obj(key, encoder, data) if encoder is not None else DEFERRED
                if got >= 0:
                    results.append(_put_ok((True, got, None)))
                elif got == TOO_BIG and not results:
                    break  # larger than any slot: the file path, written once for every key
                else:
                    results.append(self._put_declined(slots, key, data, got, expiry))
            except Exception as exc:
                if isinstance(exc, ValueError) and not isinstance(exc, WireFormatError):
                    exc = self._damaged(key, exc)  # the C table refuses a damaged mapping (its header checks)
                if not results:
                    raise exc from None  # nothing stored yet
                results.append(failed_put(exc))
        else:
            return results
        for _, _, key in targets[1:]:
            slots.take(key)  # the file path replaces an unconsumed slot payload of the key (put_obj did so for the first)
        return self._put_many_files(targets, wire.encode(data), expiry, slots)

    def _put_many_files(self, targets: list[tuple[str, str, str]], enc: wire.Encoded, expiry: Expiry | None, counted: SlotTable | None) -> list[PutResult]:
        """The file path of ``put_many``; with the slot table its file-path hint is raised first (as for a put)."""
        keys = list(dict.fromkeys(key for _, _, key in targets))  # a key named twice is put once
        if counted is not None:
            counted.files_add(len(keys))
        try:
            done = self._put_file_shared(keys, enc, expiry, counted)
        except BaseException:
            if counted is not None:
                counted.files_add(-len(keys))  # nothing was published
            raise
        if counted is not None and (unpublished := sum(not r.ok for r in done.values())):
            counted.files_add(-unpublished)
        return [done[key] for _, _, key in targets]

    def _put_file_shared(self, keys: list[str], enc: wire.Encoded, expiry: Expiry | None, counted: SlotTable | None) -> dict[str, PutResult]:
        """The file path of ``put_many``: one segment, written once, published under every key (a hard link each)."""
        names = [self._key(key) for key in keys]
        table = shared.key_table([n.digest for n in names])
        for _ in range(_PUT_RETRIES):
            seg = self._acquire(enc.nbytes + len(table), f"shm put of keys {keys!r} ({enc.nbytes} bytes)")
            try:
                header = Header(
                    self._owner, seg.no, seg.capacity, enc.nbytes, shared.table_digest(table), seg.pooled, counted is not None, shared=True
                )
                seg.view[:HEADER_SIZE] = header.pack()
                end = PAYLOAD_OFFSET + enc.nbytes
                enc.write_into(seg.view[PAYLOAD_OFFSET:end])
                seg.view[end : end + len(table)] = table
                published = self._pool.publish_many(seg, [n.published_path for n in names], self._discard, _PUT_RETRIES)
            except BaseException:
                self._pool.abandon(seg)
                raise
            if published is None:
                continue  # the segment vanished before it had a name: a new one
            if not any(published):
                self._pool.abandon(seg)
            done: dict[str, PutResult] = {}
            for key, n, ok in zip(keys, names, published, strict=True):
                if not ok:
                    done[key] = failed_put(ConnectorError(f"shm put of key {key!r} in {self._dir}: the key could not be published"))
                    continue
                self._ring(n.wake_slot)
                if expiry is not None:
                    expiry.published(n.published_path, seg)
                done[key] = PutResult(True, enc.nbytes, None)
            return done
        raise ConnectorError(f"shm put of keys {keys!r} in {self._dir}: segments keep disappearing (is gc --all running?)")

    def _put_declined(self, slots: SlotTable, key: str, data: Any, got: int, expiry: Expiry | None) -> PutResult:
        """``put`` after the slot table's ``put_obj`` declined (``got`` < 0): the Python encoder, then a slot or the file path."""
        enc = wire.encode(data)  # raises WireFormatError for what the compiled encoder declined
        if got == DEFERRED:
            if enc.nbytes <= slots.slot_bytes and slots.put(key, enc.buffers(), enc.nbytes) >= 0:
                return PutResult(True, enc.nbytes, None)
            slots.take(key)  # the file path replaces an unconsumed slot payload of the key (put_obj did so itself)
        # raise the table's file-path hint before publishing (waiting gets of table instances then look at the file path)
        slots.files_add(1)
        try:
            return self._put_file(key, enc, expiry, slots)
        except BaseException:
            slots.files_add(-1)  # nothing was published
            raise

    def _put_file(self, key: str, enc: wire.Encoded, expiry: Expiry | None, counted: SlotTable | None) -> PutResult:
        """The file path of ``put``: a pooled (or dedicated) segment published under the key's name."""
        names = self._key(key)
        published = names.published_path
        for _ in range(_PUT_RETRIES):
            seg = self._acquire(enc.nbytes, f"shm put of key {key!r} ({enc.nbytes} bytes)")
            try:
                header = Header(self._owner, seg.no, seg.capacity, enc.nbytes, names.digest, seg.pooled, counted is not None)
                seg.view[:HEADER_SIZE] = header.pack()
                enc.write_into(seg.view[PAYLOAD_OFFSET : PAYLOAD_OFFSET + enc.nbytes])
                published_ok = self._publish(seg, published, key)
            except BaseException:
                self._pool.abandon(seg)
                raise
            if published_ok:
                self._ring(names.wake_slot)
                if expiry is not None:
                    expiry.published(published, seg)
                return PutResult(True, enc.nbytes, None)
        raise ConnectorError(f"shm put of key {key!r} in {self._dir}: segments keep disappearing (is gc --all running?)")

    def _acquire(self, nbytes: int, doing: str) -> Segment:
        """A segment for ``nbytes`` of payload from the pool; running short of descriptors or memory is a
        :class:`TransientConnectorError`, any other failure a :class:`ConnectorError` (``doing`` names the put)."""
        try:
            return self._pool.acquire(nbytes)
        except OSError as exc:
            what = f"{doing} in {self._dir}: cannot get a segment"
            if shortage.is_shortage(exc):
                raise shortage.shortage_error(what, exc) from exc
            raise ConnectorError(f"{what}: {exc}") from exc

    def _publish(self, seg: Segment, published: str, key: str) -> bool:
        for _ in range(_PUT_RETRIES):
            try:
                return self._pool.publish(seg, published)
            except FileExistsError:
                self._discard(published)  # a newer put replaces an unconsumed older one
        raise ConnectorError(f"shm put of key {key!r}: the key is being republished concurrently; gave up")

    def _expire(self, expiry: Expiry) -> None:
        """ttl: free our payloads older than ``ttl_seconds`` (files before acquiring: the put can reuse them)."""
        expiry.expire()
        if self._slots is not None:
            expiry.expired += self._slots.free_mine(older_than=time.time() - expiry.ttl)

    def _reclaim_expired(self, rec: Publication) -> bool:
        """Free the publication ``rec`` if it is still published (ttl_seconds ran out)."""

        def is_ours(owner: object, seg_no: int) -> bool:
            return owner == self._owner and seg_no == rec.seg_no and (rec.seg is None or rec.seg.uses == rec.use)

        claim = self._path(self._names.claimed(self._token, next(self._claim_numbers)))
        try:
            freed, counted = reclaim(self._dir, self._names, rec.path, claim, is_ours)
        except OSError as exc:
            log.warning("shm ttl: cannot reclaim %s: %s", rec.path, exc)
            return False
        if counted and self._slots is not None:
            self._slots.files_add(-1)  # a counted file payload is gone: lower the file-path hint
        return freed

    # -- get ----------------------------------------------------------------------------
    def get(self, from_stage: Any, to_stage: Any, key: str, *, timeout: float | None = None) -> GetResult | None:
        """:meth:`Connector.get`; with the slot table a payload already there costs one C call and a decode."""
        slots = self._slots
        if slots is None or self._closed or self._views or CurrentPid.value != self._pid:
            return super().get(from_stage, to_stage, key, timeout=timeout)
        try:
            if timeout is not None and timeout > 0:
                # the first look, a sleep while no file payload may be waiting, and a second look: one C call
                deadline = time.monotonic() + timeout
                got = slots.take_or_wait(key, timeout if timeout < SLICE else SLICE)
                waits = True
            else:
                got, deadline, waits = slots.take(key), -1.0, False
        except ValueError as exc:
            self._slot_invalid(key, exc)
            return None
        if type(got) is bytearray:
            try:
                return _got((wire.decode(got), len(got)))
            except WireFormatError as exc:
                raise self._payload_error(key, exc) from exc
        # take_or_wait slept before a miss without the file-path bit (a key the table cannot hold: no sleep, None)
        slept = waits and type(got) is int and not got & FILES
        return self._get_slots(slots, key, timeout, False, got, slept, deadline)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        return self._get_impl(key, timeout, self._views)

    def get_views(self, from_stage: Any, to_stage: Any, key: str, *, timeout: float | None = None) -> GetResult | None:
        """Like :meth:`get` but tensors are zero-copy views over shared memory.

        The segment stays reserved while any tensor of the result is alive and is
        returned to its producer after the last one is garbage-collected, so do not
        keep views longer than needed (they hold pool memory).
        """
        self._check_open()
        return self._get_impl(key, timeout, True)

    def _get_impl(self, key: str, timeout: float | None, zero_copy: bool) -> GetResult | None:
        self._check_process()
        if self._slots is not None:
            return self._get_slots(self._slots, key, timeout, zero_copy)
        names = self._key(key)
        if timeout is not None and timeout > 0:
            if self._wake.futex_waits:
                claim = self._wait_claim(names, timeout)
            else:
                path = names.published_path
                claim = self._notifier.wait_for(names.wanted, lambda: self._claim(path), timeout)
        else:
            claim = self._claim(names.published_path)
        if claim is None:
            return None
        if self._notifier.tracking:
            self._notifier.forget(names.published_bytes)
        return self._consume(claim, key, names, zero_copy)

    def _get_slots(
        self,
        slots: SlotTable,
        key: str,
        timeout: float | None,
        zero_copy: bool,
        got: object = _LOOK,
        slept: bool = False,
        deadline: float = -1.0,
    ) -> GetResult | None:
        """``get`` with the slot table: the table first, then the file path, then sleep on the key's wake slot.

        ``take`` reads the wake slot's seq before it looks, and both paths' puts ring that slot after
        publishing, so a payload published after the look changes seq and the sleep (on that seq, in
        ``take_wait``, which looks again after it) returns at once. A waiting get claims on the file path
        (a ``rename``) only when the table's file-path hint says a file payload may be waiting, and after
        every sleep that ran out its slice (a lost ring, a hint gone stale under ``gc --all``); a
        non-blocking get always looks there. ``got``: the result of a first look the caller made (``take``, or
        ``take_or_wait`` with ``slept`` telling whether it slept before that miss, and ``deadline`` its clock).
        ``zero_copy``: a payload of a larger slot class is lent (views over its slot, freed when the last dies).
        """
        names: KeyNames | None = None  # the file path's names: only needed when the table has nothing
        waits = timeout is not None and timeout > 0
        always_files = not waits
        seq = 0
        wait = SLICE if slept else 0.0
        while True:
            if got is _LOOK:
                try:
                    if zero_copy:
                        got = slots.lend_wait(key, seq, wait) if slept else slots.lend(key)
                    else:
                        got = slots.take_wait(key, seq, wait) if slept else slots.take(key)
                except ValueError as exc:
                    self._slot_invalid(key, exc)
                    return None
            if type(got) is bytearray:
                try:
                    return _got((wire.decode(got), len(got)))
                except WireFormatError as exc:
                    raise self._payload_error(key, exc) from exc
            if type(got) is tuple:
                return self._lent_views(slots, key, cast(Lent, got))
            if got is None:  # a key the table cannot hold: the file path alone, sleeping on its wake slot
                if names is None:
                    names = self._key(key)
                if slept:
                    always_files = not self._wake.sleep(names.wake_slot, seq, wait)
                try:
                    seq = self._wake.seq(names.wake_slot)
                except ValueError:
                    return None
                files = True
            else:
                seq = cast(int, got)
                if slept:
                    always_files = seq >= TIMED_OUT
                    fresh = self._current_slots(slots)  # woken, and the table has nothing: replaced under us (gc --all)?
                    if fresh is not slots:
                        slots, slept, got = fresh, False, _LOOK
                        continue
                files = always_files or bool(seq & FILES)
                seq &= SEQ_MASK
            if files:
                if names is None:
                    names = self._key(key)
                claim = self._claim(names.published_path)
                if claim is not None:
                    if self._notifier.tracking:
                        self._notifier.forget(names.published_bytes)
                    return self._consume(claim, key, names, zero_copy)
            if not waits:
                return None
            now = time.monotonic()
            if deadline < 0:
                deadline = now + cast(float, timeout)
            remaining = deadline - now
            if remaining <= 0 or self._closed:
                return None
            wait = min(remaining, SLICE)
            slept = True
            got = _LOOK

    def _lent_views(self, slots: SlotTable, key: str, lent: Lent) -> GetResult | None:
        """Zero-copy views over a lent slot; the slot stays claimed by this process until the last view dies.

        A slot pins the table's mapping meanwhile (its close leaves it mapped); a crash of this process
        leaves the slot CLAIMED by a dead owner, which gc frees.
        """
        index, offset, n = lent
        try:
            anchor = np.frombuffer(slots.mm, dtype=np.uint8, count=n, offset=offset)
        except ValueError:  # closed by another thread between the claim and here: its slot goes with this process
            return None
        return self._lend(key, anchor, weakref.finalize(anchor, slots.release, index))

    def _slot_invalid(self, key: str, exc: ValueError) -> None:
        """A ``take`` that raised: the error, unless another thread closed the connector (and its mappings) meanwhile."""
        if self._closed:
            return None
        raise CorruptPayloadError(f"shm slot for key {key!r} in {self._pubdir} (namespace {self.config.namespace!r}) is invalid: {exc}") from exc

    def _current_slots(self, slots: SlotTable) -> SlotTable:
        """``slots``, or a freshly opened table if ``gc --all`` removed it while we waited (checked after each sleep).

        Instances started after the removal publish into a new table; without this a waiter
        would never see their payloads. The old table stays mapped until close (other threads
        may still be using it).
        """
        if not slots.unlinked():
            return slots
        with self._reopen_lock:
            if self._slots is slots and not self._closed:
                self._retired.append(slots)
                self._slots = self._open_slots(self._wake)
                log.warning("shm namespace %r: slot table was removed (gc --all?); opened a new one", self.config.namespace)
            return self._slots if self._slots is not None else slots

    def _wait_claim(self, names: KeyNames, timeout: float) -> str | None:
        """Claim ``names``' payload, sleeping on its futex wake slot (up to ``timeout`` seconds) until it is there.

        Read the slot, try the claim, sleep while the slot still reads the same: a publication
        after the read changes the slot (the producer rings after its rename), so none is
        missed; one before it is found by the claim. Sleeps are capped at ``wakeslots.SLICE``
        (a ring lost to a crashed producer costs at most that); the deadline is monotonic.
        """
        wake, slot, path = self._wake, names.wake_slot, names.published_path
        deadline = time.monotonic() + timeout
        while True:
            try:
                seen = wake.seq(slot)
            except ValueError:  # another thread closed the connector (and its wake file) meanwhile
                return None
            claim = self._claim(path)
            if claim is not None:
                return claim
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                return None
            wake.sleep(slot, seen, remaining)

    # -- wait_any -------------------------------------------------------------------------
    def _wait_any(self, keys: Collection[str], timeout: float, *, spin: bool = False) -> list[str]:
        self._check_process()
        if self._slots is not None:
            return self._wait_any_slots(self._slots, keys if isinstance(keys, AbstractSet) else list(keys), timeout, spin=spin)
        return self._notifier.wait_any(self._wanted(keys), self._published_prefixes, timeout)

    def _poll_any(self, keys: Collection[str], timeout: float) -> list[str]:
        # without the slot table (capability off) this is the inotify wait, as the contract's default
        return self._wait_any(keys, timeout, spin=True)

    def _wait_any_slots(self, slots: SlotTable, keys: list[str] | AbstractSet[str], timeout: float, *, spin: bool = False) -> list[str]:
        """``wait_any`` with the slot table: look in the table (and the publish directory), sleep on the namespace-wide wake slot.

        A list of keys is looked for key by key (:meth:`SlotTable.present`); a set (or a dict's keys
        view) by looking up the key of each READY slot in it (:meth:`SlotTable.ready_among`), whose
        cost does not grow with the number of keys.

        Every publication (either path) bumps that slot after publishing, and its value is read
        before looking, so an arrival after the look ends the sleep. The publish directory is read
        only when the table's file-path hint (read after the table) is not 0, and after a sleep
        that ran out its slice (as in ``get``). ``spin`` (:meth:`poll_any`): busy-poll that slot
        instead of sleeping on it, for at most :data:`SPIN_MAX_S`.
        """
        wake = self._wake
        deadline = time.monotonic() + (min(timeout, SPIN_MAX_S) if spin else timeout)
        files_anyway = False
        while True:
            try:
                seen = wake.seq(WAKE_ANY_SLOT)
                found = slots.ready_among(keys) if isinstance(keys, AbstractSet) else [keys[i] for i in slots.present(keys)]
                files = files_anyway or slots.files_add(0) > 0
            except ValueError:
                return []  # closed by another thread meanwhile
            if files:
                found += [k for k in self._notifier.wait_any(self._wanted(keys), self._published_prefixes, 0) if k not in found]
            remaining = deadline - time.monotonic()
            if found or remaining <= 0 or self._closed or self._interrupted:
                self._interrupted = False
                return found
            # a sleep or poll that ran out its time without a ring: look at the file path once more
            files_anyway = not (wake.spin if spin else wake.sleep)(WAKE_ANY_SLOT, seen, remaining)
            slots = self._current_slots(slots)
            if files_anyway and not spin:
                with contextlib.suppress(ValueError):  # closed by another thread meanwhile: the next look returns
                    slots.trim_due()  # a quiet namespace: idle slots give their memory back

    def _interrupt_wait(self) -> None:
        """End this instance's blocked ``wait_any`` (or its next one): set the flag, then ring the namespace-wide slot.

        The waiter reads that slot before it checks the flag, so a ring after its read ends its sleep and
        a flag set before its read is seen by the check. Other waiters of the namespace wake once for
        nothing (one look at the table each). Never raises (also not after close).
        """
        self._interrupted = True
        if self._slots is None:
            return
        try:
            self._wake.ring_any()
        except (ValueError, OSError):
            pass  # closed meanwhile: its waits end anyway

    def _wanted(self, keys: Collection[str]) -> dict[bytes, str]:
        """Published name -> key for ``keys``; the last set is remembered (the runtime waits on the same set again and again).

        A repeat costs one tuple comparison (element identity first, so no hashing) instead of a
        name lookup and dict insert per key. The pair is swapped in one assignment, so threads
        waiting on different sets at worst rebuild.
        """
        wanted_keys = tuple(keys)
        last = self._last_wanted
        if last is not None and last[0] == wanted_keys:
            return last[1]
        wanted = {self._key(k).published_bytes: k for k in wanted_keys}
        self._last_wanted = (wanted_keys, wanted)
        return wanted

    def _key(self, key: str) -> KeyNames:
        """Names and digest of ``key`` (cached: producers and waiters ask for the same keys again and again)."""
        cache = self._keys
        names = cache.get(key)
        if names is None:
            if len(cache) >= _NAME_CACHE_MAX:
                cache.clear()
            names = cache[key] = KeyNames(self._names, self._pubdir, key)
        return names

    def _claim(self, published_path: str) -> str | None:
        """Rename the published segment to a name only we use; None if it is not there."""
        claim = f"{self._claim_prefix}{next(self._claim_numbers)}"
        try:
            os.rename(published_path, claim)
        except FileNotFoundError:
            return None
        except OSError as exc:  # e.g. EPERM: a file of another user squats the name in the sticky /dev/shm
            raise ConnectorError(f"shm get: cannot claim {os.path.basename(published_path)!r} in {self._dir}: {exc}") from exc
        return claim

    def _invalid(self, claim: str, key: str, why: str) -> CorruptPayloadError:
        """Remove what was claimed under ``key`` (a file, or an empty directory planted there) and say why."""
        try:
            unlink_quiet(claim)
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                os.rmdir(claim)
        except OSError:
            pass
        return CorruptPayloadError(
            f"shm segment for key {key!r} in {self._dir} (namespace {self.config.namespace!r}) is invalid: {why}; removed it"
        )

    def _open_claimed(self, claim: str, key: str, names: KeyNames) -> tuple[Header, Mapping] | None:
        """Header and mapping of a claimed segment (one ``stat`` when its mapping is cached); None if it is gone.

        Running short of descriptors or mappings while opening it is not a bad segment: the map
        cache gives up its idle mappings (when they hold some of what ran short) and the open is
        tried once more; failing again, the segment is published again and the get raises
        :class:`TransientConnectorError` (see :meth:`_unclaim`).
        """
        retried = False
        while True:
            try:
                return self._read_claimed(claim, key, names.digest)
            except (OSError, MemoryError) as exc:
                if not shortage.is_shortage(exc):
                    raise
                # idle cached mappings hold address space and mappings (and descriptors where a mapping keeps one)
                cache_helps = MAPPING_HOLDS_FD or not shortage.is_descriptor_shortage(exc)
                if retried or not cache_helps or not self._maps.shed():
                    raise self._unclaim(claim, key, names, "cannot open its segment", exc) from exc
                retried = True

    def _read_claimed(self, claim: str, key: str, digest: bytes) -> tuple[Header, Mapping] | None:
        """:meth:`_open_claimed` once: a bad segment is removed (:class:`CorruptPayloadError`), a shortage raises as it came."""
        try:
            st = os.lstat(claim)  # never follow a symlink planted under a key's name
        except FileNotFoundError:
            return None  # gc removed it under us (its producer died)
        if not stat.S_ISREG(st.st_mode):
            raise self._invalid(claim, key, "not a regular file")
        ident = (st.st_dev, st.st_ino)
        cached = self._maps.lookup(ident)
        try:
            if cached is not None:
                header = Header.unpack(cached.view, st.st_size)
                if header.capacity != cached.capacity:
                    raise HeaderError("size changed since it was mapped")
            else:
                read = self._read_header(claim, st.st_size)
                if read is None:
                    return None
                header = read
            if header.shared and cached is not None:
                shared.check_key_table(lambda offset, size: bytes(cached.view[offset : offset + size]), header, digest)
            elif header.key_digest != digest and not header.shared:
                raise HeaderError("it holds a payload for a different key")
        except HeaderError as exc:
            raise self._invalid(claim, key, str(exc)) from exc
        if cached is not None:
            return header, cached
        try:
            fd = os.open(claim, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if shortage.is_shortage(exc):
                raise
            raise self._invalid(claim, key, f"cannot open it read-write: {exc}") from exc
        try:
            if header.shared:  # a segment of several keys: is this one of them (the key table after its payload)
                shared.check_key_table(lambda offset, size: os.pread(fd, size, offset), header, digest)
            return header, self._maps.map(ident, fd, header)
        except HeaderError as exc:
            raise self._invalid(claim, key, str(exc)) from exc
        except (OSError, ValueError) as exc:
            if shortage.is_shortage(exc):
                raise
            raise self._invalid(claim, key, f"cannot be mapped: {exc}") from exc
        finally:
            os.close(fd)  # the mapping does not need it

    @staticmethod
    def _read_header(path: str, size: int) -> Header | None:
        """The header of the segment at ``path`` (None if it is gone); a shortage of descriptors raises as it came."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if shortage.is_shortage(exc):
                raise
            raise HeaderError(f"cannot open: {exc}") from exc
        try:
            return Header.unpack(os.pread(fd, HEADER_SIZE, 0), size)
        finally:
            os.close(fd)

    def _unclaim(self, claim: str, key: str, names: KeyNames, doing: str, exc: BaseException) -> TransientConnectorError:
        """Publish a claimed segment again under its key's name and say why the get gave it up.

        The get ran short of a resource and read nothing, so the payload goes back exactly as
        it was before the claim: readable by a retry of this get, by a later get of the key or
        by another consumer (a waiter is rung), freed by its producer's close, ttl or gc like any
        published payload, and never left under this consumer's claim name (which only gc after
        this process's death would free). If a newer put of the key published meanwhile, that one
        replaces it, as a put replaces an unconsumed payload.
        """
        where = f"shm get of key {key!r} in {self._dir} (namespace {self.config.namespace!r}): {doing}"
        try:
            rename_noreplace(claim, names.published_path)
        except FileExistsError:
            self._discard_claimed(claim)
            return shortage.shortage_error(f"{where} (a newer put of the key replaced it meanwhile)", exc)
        except FileNotFoundError:
            return shortage.shortage_error(f"{where} (and gc removed it meanwhile)", exc)
        except OSError as err:  # cannot happen short of a broken tmpfs: keep it claimed (gc frees it after this process)
            log.error("shm: cannot publish %s again as %s: %s", claim, names.published_path, err)
            return shortage.shortage_error(f"{where} (kept under {claim}: {err})", exc)
        self._ring(names.wake_slot)
        return shortage.shortage_error(f"{where}; the payload is kept for a retry", exc)

    def _discard_claimed(self, claim: str) -> None:
        if free_claimed(self._dir, self._names, claim) and self._slots is not None:
            self._slots.files_add(-1)  # a counted file payload is gone: lower the file-path hint

    def _consumed(self, header: Header) -> None:
        if header.counted and self._slots is not None:
            self._slots.files_add(-1)  # consumed: lower the table's file-path hint

    def _consume(self, claim: str, key: str, names: KeyNames, zero_copy: bool) -> GetResult | None:
        opened = self._open_claimed(claim, key, names)
        if opened is None:
            return None
        header, mapping = opened
        n = header.payload_len
        if zero_copy:
            self._consumed(header)
            return self._consume_views(claim, key, header, mapping)
        try:
            buf = self._private_copy(mapping.view[PAYLOAD_OFFSET : PAYLOAD_OFFSET + n])
        except BaseException as exc:
            if not shortage.is_shortage(exc):
                self._consumed(header)
                _return_segment(self._dir, self._names, claim, header, mapping, self._maps, leased=False)
                raise
            if not mapping.cached:
                mapping.drop()
            raise self._unclaim(claim, key, names, f"no memory for its {n}-byte copy", exc) from exc
        self._consumed(header)
        _return_segment(self._dir, self._names, claim, header, mapping, self._maps, leased=False)
        try:
            data = wire.decode(buf, copy=False)
        except WireFormatError as exc:
            raise self._payload_error(key, exc) from exc
        return GetResult(data, n)

    def _payload_error(self, key: str, exc: WireFormatError) -> WireFormatError:
        """The decoder's error, naming the key and namespace the bad payload came from."""
        return WireFormatError(f"shm payload for key {key!r} (namespace {self.config.namespace!r}): {exc}")

    def _private_copy(self, src: memoryview) -> memoryview:
        """Copy ``src`` into memory this process owns (the owned result)."""
        n = src.nbytes
        if n < _PRIVATE_MIN:
            dst = memoryview(bytearray(n))
            dst[:] = src
            return dst
        anchor = self._private.take(n)
        copy_into(anchor, src)
        return memoryview(anchor.data)

    def _consume_views(self, claim: str, key: str, header: Header, mapping: Mapping) -> GetResult:
        n = header.payload_len
        self._maps.lease(mapping)
        # every view decoded from `anchor` keeps it alive; when the last one dies the segment goes back
        anchor = np.frombuffer(mapping.view, dtype=np.uint8, count=n, offset=PAYLOAD_OFFSET)
        give_back = weakref.finalize(anchor, _return_segment, self._dir, self._names, claim, header, mapping, self._maps, True)
        return self._lend(key, anchor, give_back)

    def _lend(self, key: str, anchor: np.ndarray, give_back: weakref.finalize) -> GetResult:
        """Views decoded over ``anchor``; ``give_back`` runs when the last of them is gone (at once when decoding fails)."""
        give_back.atexit = False
        try:
            data = wire.decode(memoryview(anchor.data), copy=False)
        except WireFormatError as exc:
            give_back()
            raise self._payload_error(key, exc) from exc
        return GetResult(data, anchor.nbytes)

    # -- cleanup / close --------------------------------------------------------------------
    def _cleanup(self, key: str) -> bool:
        self._check_process()
        names = self._key(key)
        found = False
        if self._slots is not None:
            try:
                found = type(self._slots.take(key)) is bytearray
            except ValueError:
                found = True  # a corrupt slot of the key: take freed it
        return self._discard(names.published_path) or found

    def _discard(self, published_path: str) -> bool:
        """Claim and free whatever is published at ``published_path``; True if something was there."""
        claim = self._path(self._names.claimed(self._token, next(self._claim_numbers)))
        try:
            os.rename(published_path, claim)
        except FileNotFoundError:
            return False
        self._discard_claimed(claim)
        return True

    def _close(self) -> None:
        if os.getpid() != self._owner.pid:
            return  # a forked child must not free its parent's segments
        unlink_quiet(self._marker)
        self._notifier.close()
        self._free_unconsumed()
        for table in [*self._retired, *([self._slots] if self._slots is not None else [])]:
            try:
                table.free_mine()
            except ValueError as exc:  # a damaged table header: release the rest regardless
                log.warning("shm namespace %r: slot table is damaged (%s); this instance's slots were not freed", self.config.namespace, exc)
            table.close()  # removes the table if no other live instance holds it
        self._pool.close()
        self._maps.clear()
        self._private.clear()
        self._wake.close()  # removes the wake file if no other live instance holds it
        pubdir.remove_if_empty(self._pubdir)  # succeeds for the last instance of the namespace

    def _free_unconsumed(self) -> None:
        """Unlink payloads this instance published that nobody consumed."""
        for entry in _scan(self._pubdir, self._names.prefix):
            parsed = parse_name(entry)
            if parsed is None or parsed.kind not in ("k", "h"):
                continue
            path = f"{self._pubdir}/{entry}"
            try:
                header = gc.read_header(path)
            except OSError:  # out of descriptors: leave it (gc frees it once this instance's marker is gone)
                continue
            if header is not None and header.owner == self._owner:
                claim = self._path(self._names.claimed(self._token, next(self._claim_numbers)))
                try:
                    os.rename(path, claim)
                except FileNotFoundError:
                    continue
                try:
                    again = gc.read_header(claim)
                except OSError:
                    again = None
                if again is not None and again.owner == self._owner:
                    unlink_quiet(claim)
                    if again.counted and self._slots is not None:
                        self._slots.files_add(-1)
                else:  # republished by someone else in between: put it back
                    try:
                        os.rename(claim, path)
                    except OSError:
                        unlink_quiet(claim)

    def _health(self) -> dict[str, Any]:
        return {
            "namespace": self.config.namespace,
            "shm_dir": self._dir,
            "owner": self._token,
            "zero_copy": self.config.zero_copy,
            **self._pool.stats(),
            **self._maps.stats(),
            **self._private.stats(),
            "slot_table_bytes": self._slots.committed_bytes() if self._slots is not None else 0,
            "ttl_seconds": self.config.ttl_seconds,
            "expired": self._expiry.expired if self._expiry is not None else 0,
        }

    @property
    def owner_token(self) -> str:
        """``<pid>-<start>-<tag>``: appears in the names of segments this instance owns."""
        return self._token


def _scan(directory: str, prefix: str) -> list[str]:
    try:
        with os.scandir(directory) as it:
            return [e.name for e in it if e.name.startswith(prefix)]
    except FileNotFoundError:
        return []


def _return_segment(directory: str, names: Names, claim: str, header: Header, mapping: Mapping, maps: MapCache, leased: bool) -> None:
    """After a get: give a pooled segment back to its owner, or unlink it (one of several names: drop that name,
    unless it is the last; see :mod:`.segments.shared`).

    Order matters: rename to ``f.`` first, set FREE second (FREE promises the ``f.`` name),
    then read the owner's CLOSED flag: an owner that closed meanwhile either unlinked the
    ``f.`` name itself or set the flag before we looked. Runs inline (owned copies) or from a
    weakref finalizer in any thread (zero-copy views); never raises.
    """
    try:
        if header.pooled and header.shared and not shared.leave(claim):  # other keys of a fan-out still hold it
            return
        if header.pooled:
            ident = (header.owner, header.seg_no)
            if mapping.free_for != ident:
                mapping.free_for = ident
                # back only to an instance that is open (its marker exists): a header naming anyone
                # else (crafted, or an owner gone without closing) would leave an f. file nobody frees
                marker = f"{directory}/{names.publish_dir}/{names.marker(header.owner.token)}"
                mapping.free_path = f"{directory}/{names.free(header.owner.token, header.seg_no)}" if os.path.exists(marker) else None
            free = mapping.free_path
            if free is None:
                unlink_quiet(claim)
                return
            try:
                os.rename(claim, free)
            except FileNotFoundError:
                pass
            else:
                mapping.view[STATE_OFFSET] = STATE_FREE
                if mapping.view[CLOSED_OFFSET]:
                    unlink_quiet(free)
        else:
            unlink_quiet(claim)
    except Exception:  # pragma: no cover - a finalizer must not raise
        log.exception("shm: returning segment %s failed", claim)
    finally:
        if leased:
            maps.unlease(mapping)
        elif not mapping.cached:
            mapping.drop()
