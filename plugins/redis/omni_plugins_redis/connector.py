"""``RedisConnector``: payloads through Redis, Redis Cluster or a Sentinel-managed primary.

Write path (:meth:`_put`): encode with ``omni_plugins.wire`` (zero copy),
frame with :mod:`.packing` and send through redis-py's connection straight
from tensor memory (no Python copy). A large payload's ``chunk_bytes`` parts
are written first (one pipeline, each acknowledged); then one ``MULTI`` ...
``EXEC`` pushes the manifest, its TTL and a commit marker. Only the manifest
makes a payload visible and the transaction is atomic, so a reader never sees
half a payload; one round trip per small put, two per large one. With
``min_replica_acks`` a ``WAIT`` follows the commit in the same write.

``put_many`` (a fan-out: one payload under several keys) encodes once and
builds each key's parts and manifest over the same encoder buffers. The puts
that land on one server (every key, on one server or a Sentinel group; a
cluster node's keys, grouped by slot owner) share one connection: each key's
parts (large payloads) are written and acknowledged first, then every key's
commit transaction goes in one write, followed by one ``WAIT`` for all.
Each key keeps its own commit marker and the same guarantees as a ``put``; a
key whose commit is refused, or a group whose write fails, falls back to a
``put`` of that key alone (the usual retries, the commit-marker check).

A put whose outcome is unknown -- its reply lost, and the withdrawal of a
commit that may have gone in not possible either (the server unreachable, a
partition) -- is remembered by key. When the caller retries it (the same key
and the same payload object, as the runtime's send thread does) the retry
continues that put: its commit marker says whether the first commit went in,
so the payload is committed once, never twice. Any other put of that key, a
``cleanup`` of it and :meth:`close` withdraw the unsettled one first.

Read path (:meth:`_get`): claim the manifest atomically (``LMOVE``/``BLMOVE``
into a private claim list, see :mod:`.waiting`), stream the parts straight
into one preallocated buffer (:mod:`.replies`), delete claim and parts (the
parts with the next parted put to that server, see :class:`.client.NodeQueue`),
and decode with ``omni_plugins.wire`` over that buffer (``copy=False``):
tensors own that memory, one copy in total.

All keys of one payload share a hash tag (:mod:`.keys`), so in a cluster they
live on one node and each step talks to one connection.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
from redis.exceptions import ExecAbortError, RedisError, ResponseError

from omni_plugins import wire
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult, failed_put
from omni_plugins.errors import ConnectorClosedError, ConnectorError, CorruptPayloadError
from omni_plugins.wire import empty_bytes
from omni_plugins_redis import manifest as mf
from omni_plugins_redis.client import Link, RedisClient, retryable
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.packing import Buffer, Pieces, frame_key_command, pack_many
from omni_plugins_redis.replies import ProtocolError
from omni_plugins_redis.waiting import Claimer, peek_claim

log = logging.getLogger(__name__)

#: Every command the connector sends; an ACL user needs these (plus ``cluster|slots`` and
#: ``command``, which redis-py's ``RedisCluster`` asks at start, in cluster mode) and the key
#: pattern ``~<key_prefix>*``. Without ``blmove``, ``get(timeout=)`` falls back to polling;
#: ``wait``, ``watch`` and ``unwatch`` serve ``min_replica_acks``.
ACL_COMMANDS = (
    "get", "set", "rpush", "lpush", "lrem", "lmove", "blmove", "pexpire", "exists",
    "del", "unlink", "multi", "exec", "lrange", "lindex", "ping", "wait", "watch", "unwatch",
)  # fmt: skip


def acl_rule(key_prefix: str, *, cluster: bool = False, commands: tuple[str, ...] = ACL_COMMANDS) -> str:
    """The ACL rule (keys and commands) a least-privilege user of this connector needs."""
    extra = " +cluster|slots +command" if cluster else ""
    return f"~{key_prefix}* resetchannels -@all " + " ".join(f"+{c}" for c in commands) + extra


# Parts outlive their manifest by this much, so a reader that claims a manifest
# just before it expires still finds every part.
PART_TTL_GRACE_MS = 60_000
# A commit marker only has to outlive the writer's retries.
MARKER_TTL_MS = 600_000
# What a commit marker says once its put gave up waiting for replicas (min_replica_acks): discard, do not give back.
WITHDRAWN = b"withdrawn"
# Failed puts remembered for their retry (the oldest beyond this expire by TTL).
MAX_UNSETTLED = 1024
# Deleting the parts of a discarded payload (whose manifest may announce many): keys per UNLINK, UNLINKs per round trip.
UNLINK_BATCH = 512
UNLINK_PIPELINE = 16
# Inline payloads up to this size are joined into one ``bytes`` (cheaper than vectored pieces).
SMALL_INLINE_BYTES = 32 * 1024
# The transaction of a small inline put, framed in one step: MULTI, RPUSH manifest element,
# [PEXPIRE manifest ttl,] SET marker 1 PX MARKER_TTL_MS, EXEC.
_MARKER_SET_TAIL = b"$1\r\n1\r\n$2\r\nPX\r\n$%d\r\n%d\r\n*1\r\n$4\r\nEXEC\r\n" % (len(str(MARKER_TTL_MS)), MARKER_TTL_MS)
_INLINE_COMMIT_TTL = (
    b"*1\r\n$5\r\nMULTI\r\n*3\r\n$5\r\nRPUSH\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n*3\r\n$7\r\nPEXPIRE\r\n$%d\r\n%b\r\n%b"
    b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n" + _MARKER_SET_TAIL
)
_INLINE_COMMIT = b"*1\r\n$5\r\nMULTI\r\n*3\r\n$5\r\nRPUSH\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n" + _MARKER_SET_TAIL


@dataclass
class _PutState:
    """One put across retries."""

    keys: PayloadKeys
    manifest: mf.Manifest
    element: bytes | Pieces
    parts: list[Pieces]
    attempts: int = 0
    # parts of payloads consumed earlier on the connection, deleted one before each of ours
    retired: list[bytes] = field(default_factory=list)
    # withdrawn already: queued behind it on the connection close() aborted, or after replicas fell short
    withdrawn: bool = False
    # the caller's payload (kept only while the put is unsettled: a retry with the same object continues it)
    data: Any = None


@dataclass
class _ReadState:
    """One get's part reads across retries: where to resume, and the payload buffer once part 0 was checked."""

    keys: PayloadKeys
    manifest: mf.Manifest
    next_part: int = 0
    buffer: np.ndarray | None = None
    whole: memoryview | None = None
    # its give-back was queued on the connection close() aborted (see RedisConnector._read_parts)
    restored: bool = False


class ReplicaAckError(ConnectorError):
    """Fewer replicas than ``min_replica_acks`` confirmed a put within ``replica_ack_timeout``; the put was withdrawn."""


class RedisConnector(Connector):
    """Redis / Redis Cluster / Sentinel connector (see module docstring for the protocol)."""

    capabilities = Capabilities(blocking_get=True, cross_process=True, cross_host=True, zero_copy_get=False, consume_on_get=True)

    def __init__(self, config: RedisConfig) -> None:
        super().__init__()
        self.config = config
        self._client = RedisClient(config)
        self._claimer = Claimer(self._client, config, self._settle_unconfirmed)
        # Claim lists are named by this instance and a per-get counter: a deferred delete of
        # one get's claim list can never hit a later get's. A get that lost its reply (or the
        # server, while reading parts) records its claim list, and the next get of the key
        # looks there first.
        self._claim_tag = mf.new_put_id()
        self._claim_ids = itertools.count()
        self._suspect: dict[str, bytes] = {}  # key -> claim list that may still hold a payload
        self._suspect_lock = threading.Lock()
        ttl_ms = round(config.ttl_seconds * 1000)
        self._ttl_ms = ttl_ms
        self._inline_max = min(config.inline_bytes, config.chunk_bytes)
        self._ttl_frame = b"$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)
        self._commit_replies = 5 if ttl_ms else 4  # MULTI, the queued commands, EXEC
        self._part_ttl_ms = ttl_ms + PART_TTL_GRACE_MS if ttl_ms else 0
        self._reuse_parts = config.reuse_part_memory and config.lazy_cleanup
        # key -> a failed put whose commit may have gone in and could not be withdrawn (see the module docstring)
        self._unsettled: dict[str, _PutState] = {}
        self._unsettled_lock = threading.Lock()
        self._acks = config.min_replica_acks
        self._wait: tuple[str, int, int] | None = None
        self._wait_frame = b""
        if self._acks:
            self._wait = ("WAIT", self._acks, round(config.replica_ack_timeout * 1000))
            self._wait_frame = b"".join(pack_many([self._wait]))
        # the replies of a commit transaction when all went well (MULTI, queued commands, EXEC[, WAIT]): one match
        queued = 3 if ttl_ms else 2
        committed = rb"\+OK\r\n" + rb"\+QUEUED\r\n" * queued + b"\\*%d\r\n:\\d+\r\n" % queued + (rb":1\r\n" if ttl_ms else b"") + rb"\+OK\r\n"
        self._committed = re.compile(committed + (rb":(\d{1,19})\r\n" if self._acks else b""))
        #: one commit of a pipelined group (put_many): its WAIT comes once, after the group's last commit
        self._committed_alone = re.compile(committed)

    # -- helpers -------------------------------------------------------------
    def _keys(self, key: str) -> PayloadKeys:
        try:
            return PayloadKeys(self.config.key_prefix, key, slot=-1 if self.config.cluster else 0)
        except ValueError as exc:
            raise ConnectorError(f"Redis {self._client.label}: {exc}") from None

    def _expiry(self, ttl_ms: int) -> tuple[Any, ...]:
        return ("PX", ttl_ms) if ttl_ms else ()

    # -- put -------------------------------------------------------------------
    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        prior = self._take_unsettled(key, data)
        if prior is not None:
            return self._settle(key, prior)  # the caller retries that very put: continue it, commit once
        keys = self._keys(key)
        return self._settle(key, self._put_state(keys, _Body(wire.encode(data), self._inline_max, self.config.chunk_bytes)), data)

    def _take_unsettled(self, key: str, data: Any) -> _PutState | None:
        """The unsettled put of ``key`` when ``data`` retries it (the same object); any other one is withdrawn first."""
        if not self._unsettled:
            return None
        with self._unsettled_lock:
            prior = self._unsettled.pop(key, None)
        if prior is not None and prior.data is not data:
            self._abandon(prior)
            return None
        return prior

    def _put_state(self, keys: PayloadKeys, body: _Body) -> _PutState:
        """A fresh put of ``body`` under ``keys``: its own put id, manifest and parts (over the encoder's buffers)."""
        put_id = mf.new_put_id()
        if body.parts is not None:
            manifest = mf.for_parts(body.total, self.config.chunk_bytes, put_id)
            return _PutState(keys=keys, manifest=manifest, element=Pieces([manifest.header()]), parts=[Pieces(p) for p in body.parts])
        manifest = mf.for_inline(body.total, put_id)
        # small: one bytes (header and payload joined), framed in one step
        element = b"".join([manifest.header(), *body.buffers]) if body.small else Pieces([manifest.header(), *body.buffers])
        return _PutState(keys=keys, manifest=manifest, element=element, parts=[])

    # -- put_many ----------------------------------------------------------------
    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        """Encode once; the keys of one server in one pipelined write (see the module docstring)."""
        body = _Body(wire.encode(data), self._inline_max, self.config.chunk_bytes)  # WireFormatError: nothing stored
        results: list[PutResult | None] = [None] * len(targets)
        groups: dict[int, list[tuple[int, str, _PutState]]] = {}
        for i, (_, _, key) in enumerate(targets):
            try:
                prior = self._take_unsettled(key, data)
                if prior is not None:  # a retry of this key's unsettled put: continued alone, as put does
                    results[i] = self._settle(key, prior)
                    continue
                state = self._put_state(self._keys(key), body)
                server = id(self._client.topology.route(state.keys.slot)) if self.config.cluster else 0
            except (ConnectorError, ConnectorClosedError) as exc:
                results[i] = failed_put(exc)
                continue
            except (RedisError, OSError):  # the slot map cannot be read now: this key goes alone (its put retries)
                server = -1 - i
            groups.setdefault(server, []).append((i, key, state))
        for members in groups.values():
            if len(members) == 1:
                i, key, state = members[0]
                results[i] = self._settle_or_fail(key, state, data)
                continue
            for i, result in self._put_group(members, data):
                results[i] = result
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _settle_or_fail(self, key: str, state: _PutState, data: Any) -> PutResult:
        """:meth:`_settle` with its failure as a result: the other keys of a ``put_many`` may be stored."""
        try:
            return self._settle(key, state, data)
        except Exception as exc:
            return failed_put(exc)

    def _put_group(self, group: list[tuple[int, str, _PutState]], data: Any) -> list[tuple[int, PutResult]]:
        """Fresh puts to one server in one write; a key that does not commit there is settled alone (``_settle``)."""
        outcome: dict[int, PutResult] = {}  # index -> result; a key without one settles alone
        refused: dict[int, ConnectorError] = {}  # index -> why its commit was refused for good

        def step(link: Link) -> None:
            states = [state for _, _, state in group]
            for state in states:
                state.attempts += 1
            for state in states:
                if state.parts:
                    self._write_parts(link, state)
            frames: list[Any] = []
            for state in states:
                frames += self._commit_frames(state, with_wait=False)
            if self._wait_frame:
                frames.append(self._wait_frame)
            link.send_frames(frames)
            committed: list[tuple[int, _PutState]] = []
            for i, key, state in group:
                if link.expect(self._committed_alone) is not None:
                    committed.append((i, state))
                    continue
                try:
                    self._check_commit(link.read_many(self._commit_replies))
                except RedisError as exc:  # this key's transaction was refused: MOVED and the like settle it alone
                    if not retryable(exc):
                        refused[i] = ConnectorError(f"put {key!r} on Redis {link.route.name}: {type(exc).__name__}: {exc}")
                    continue
                committed.append((i, state))
            acked = link.read() if self._wait is not None else None
            for i, state in committed:
                if self._wait is not None:
                    try:
                        self._check_acks(link, state, acked)
                    except ReplicaAckError as exc:
                        outcome[i] = failed_put(exc)
                        continue
                marker = state.keys.marker(state.manifest.put_id)
                link.defer(state.keys.slot, "DEL", marker, frame=frame_key_command("DEL", marker))
                outcome[i] = PutResult(True, state.manifest.total, {"parts": state.manifest.nparts})

        first = group[0][2].keys
        try:
            self._client.run(first.slot, step, what="put", key=first.key, retries=0)
        except (ConnectorError, ConnectorClosedError) as exc:  # the write or a reply was lost: each key not done settles alone
            log.debug("put of %d keys on Redis %s failed (%s); settling them one by one", len(group), self._client.label, exc)
        done: list[tuple[int, PutResult]] = []
        for i, key, state in group:
            if i in refused:  # as a put whose commit is refused: withdrawn (or remembered), failed
                self._give_up(key, state, data)
                done.append((i, failed_put(refused[i])))
            else:
                found = outcome.get(i)
                done.append((i, found if found is not None else self._settle_or_fail(key, state, data)))
        return done

    def _commit_frames(self, state: _PutState, *, with_wait: bool) -> list[Any]:
        """The framed commit transaction of ``state`` (MULTI, manifest, TTL, marker, EXEC), with ``WAIT`` if asked."""
        keys, marker = state.keys, state.keys.marker(state.manifest.put_id)
        if isinstance(state.element, bytes):  # small inline payload: one template
            return [self._inline_commit(keys.manifest, marker, state.element) + (self._wait_frame if with_wait else b"")]
        commit: list[tuple[Any, ...]] = [("MULTI",), ("RPUSH", keys.manifest, state.element)]
        if self._ttl_ms:
            commit.append(("PEXPIRE", keys.manifest, self._ttl_ms))
        commit += [("SET", marker, b"1", "PX", MARKER_TTL_MS), ("EXEC",)]
        return pack_many([*commit, self._wait] if with_wait and self._wait is not None else commit)

    def _settle(self, key: str, state: _PutState, data: Any = None) -> PutResult:
        """Run ``state``'s put to its end; on failure withdraw it, or remember it when even that is not possible."""

        def step(link: Link) -> None:
            try:
                self._put_step(link, state)
            except BaseException:
                if link.aborted and not state.withdrawn:
                    # close() cut the put short, maybe with its commit already sent to a stalled server: the
                    # withdrawal goes behind it on the same connection, so the server runs it after the commit
                    state.withdrawn = link.send_last(self._abandon_commands(state))
                raise

        try:
            self._client.run(state.keys.slot, step, what="put", key=key)
        except (ConnectorError, ConnectorClosedError):
            self._give_up(key, state, data)
            raise
        state.data = None
        return PutResult(True, state.manifest.total, {"parts": state.manifest.nparts})

    def _give_up(self, key: str, state: _PutState, data: Any) -> None:
        """After a failed put: withdraw it, or remember it for its retry when even that is not possible."""
        if not self._abandon(state) and state.attempts and not self.closed:
            state.data = data if data is not None else state.data
            with self._unsettled_lock:
                if len(self._unsettled) >= MAX_UNSETTLED:
                    self._unsettled.pop(next(iter(self._unsettled)))  # the oldest expires by TTL
                self._unsettled[key] = state

    def _put_step(self, link: Link, state: _PutState) -> None:
        keys, manifest = state.keys, state.manifest
        marker = keys.marker(manifest.put_id)
        state.attempts += 1
        if state.attempts > 1 and (decided := link.call("GET", marker)) is not None:  # the lost reply was a successful commit
            if decided == WITHDRAWN:
                state.withdrawn = True
                raise ReplicaAckError(f"put {keys.key!r} on Redis {link.route.name}: withdrawn (min_replica_acks not reached)")
            if self._wait is not None:  # durable on the replicas of the primary that has it now?
                link.send([("PEXPIRE", marker, MARKER_TTL_MS), self._wait])
                self._check_acks(link, state, link.read_many(2)[1])
            link.defer(keys.slot, "DEL", marker, frame=frame_key_command("DEL", marker))
            return
        # One transaction: manifest, TTL and commit marker become visible together or not
        # at all; parts (large payloads) are written and acknowledged before it.
        if state.parts:
            self._write_parts(link, state)
        link.send_frames(self._commit_frames(state, with_wait=True))
        found = link.expect(self._committed)
        if found is None:  # not every reply as expected: read them one by one
            self._check_commit(link.read_many(self._commit_replies))
            acked = link.read() if self._wait is not None else None
        else:
            acked = int(found.group(1)) if self._wait is not None else None
        if self._wait is not None:
            self._check_acks(link, state, acked)
        link.defer(keys.slot, "DEL", marker, frame=frame_key_command("DEL", marker))

    def _check_acks(self, link: Link, state: _PutState, acked: Any) -> None:
        """The ``WAIT`` reply after a commit: fewer than ``min_replica_acks`` replicas withdraw the put.

        The commit is visible before ``WAIT`` answers, so a reader may hold the
        payload (claimed, not yet delivered: a reader delivers only what the
        replicas confirmed, see :meth:`_settle_unconfirmed`). In order:
        withdraw it if it is still in its list; else wait once more, as the
        reader does (replicas confirming its claim confirm this commit too);
        else withdraw for good, with the marker set to ``withdrawn`` so the
        reader holding it discards it instead of giving it back. One decision
        either way: a put that fails leaves nothing behind and is never delivered.
        """
        if isinstance(acked, RedisError):
            raise acked
        if not isinstance(acked, int) or acked >= self._acks or self._wait is None:
            return
        keys, manifest = state.keys, state.manifest
        marker = keys.marker(manifest.put_id)
        element = self._element_bytes(state)
        if _reply(link, ("LREM", keys.manifest, 0, element)):  # no reader took it
            self._withdrawn(link, state, acked)
        if _int_reply(_reply(link, self._wait)) >= self._acks:
            return
        link.send([("MULTI",), ("LREM", keys.manifest, 0, element), ("SET", marker, WITHDRAWN, "PX", MARKER_TTL_MS), ("EXEC",)])
        replies = link.read_many(4)
        self._check_commit(replies)
        results = replies[-1]
        removed = results[0] if isinstance(results, list) else 0
        if removed:  # given back meanwhile: withdrawn here; else the reader holding it discards it
            self._withdrawn(link, state, acked)
        state.withdrawn = True
        raise self._ack_error(link, state, acked)

    def _withdrawn(self, link: Link, state: _PutState, acked: int) -> NoReturn:
        """The put's element is out of its list: delete marker and parts, fail the put."""
        keys, manifest = state.keys, state.manifest
        _run_pipelined(link, iter([("UNLINK", keys.marker(manifest.put_id), *keys.parts(manifest.put_id, manifest.nparts))]))
        state.withdrawn = True
        raise self._ack_error(link, state, acked)

    def _ack_error(self, link: Link, state: _PutState, acked: int) -> ReplicaAckError:
        return ReplicaAckError(
            f"put {state.keys.key!r} on Redis {link.route.name}: {acked} of {self._acks} replica(s) confirmed it within "
            f"{self.config.replica_ack_timeout}s (min_replica_acks); the put was withdrawn"
        )

    def _settle_unconfirmed(self, link: Link, keys: PayloadKeys, claim_key: bytes, element: bytes | bytearray) -> bool:
        """A claim whose ``WAIT`` fell short: True to deliver the payload, False when it was given back or discarded.

        The payload's commit marker tells what its writer decided: gone means
        the put was confirmed (and cleaned up), so deliver; ``withdrawn`` means
        it failed, so discard it; ``1`` means undecided, so put it back at the
        head of its list for a later get (``WATCH`` on the marker makes that
        atomic with the writer's decision).
        """
        try:
            manifest = mf.parse(element, self.config.max_payload_bytes)
        except mf.ManifestError:
            return True  # reported as corrupt by the get
        marker = keys.marker(manifest.put_id)
        for _ in range(16):  # WATCH fails only when the writer decided meanwhile: then look again
            link.send([("WATCH", marker), ("GET", marker)])
            decided = link.read_many(2)[1]
            if isinstance(decided, RedisError):
                raise decided
            if decided is None:
                _reply(link, ("UNWATCH",))
                return True
            if decided == WITHDRAWN:
                _reply(link, ("UNWATCH",))
                doomed = [claim_key, marker, *keys.parts(manifest.put_id, manifest.nparts)]
                _run_pipelined(link, iter([("UNLINK", *doomed)]))
                return False
            commands = self._restore_commands(keys, element, claim_key)
            link.send(commands)
            replies = link.read_many(len(commands))
            if replies[-1] is not None:  # not aborted by the WATCH
                self._check_commit(replies)
                return False
        return False

    def _write_parts(self, link: Link, state: _PutState) -> None:
        """Write the parts (one pipeline, one round trip) and check that every one was stored.

        Parts go first and outside the commit transaction: nothing refers to them
        until the manifest is pushed, and the commit is sent only once all are
        acknowledged (a refused part, e.g. OOM or an ACL denial, fails the put before
        anything is visible). The parts of payloads this connection's gets consumed
        earlier (:meth:`Connection.retire`) are deleted one right before each new
        part: the server then stores each new part in the memory the old one just
        left, instead of in fresh pages it must first fault in (for 64 MiB puts this
        roughly halves the server's CPU and page faults; see docs/backends/redis.md).
        """
        manifest = state.manifest
        state.retired += link.take_retired()
        old = state.retired  # one key per delete: parts of different payloads may have different hash tags
        expiry = self._expiry(self._part_ttl_ms)
        commands: list[tuple[Any, ...]] = [("UNLINK", key) for key in old[len(state.parts) :]]
        for i, (key, part) in enumerate(zip(state.keys.parts(manifest.put_id, manifest.nparts), state.parts, strict=True)):
            if i < len(old):
                commands.append(("UNLINK", old[i]))
            commands.append(("SET", key, part, *expiry))
        link.send(commands)
        replies = link.read_many(len(commands))
        refused = None
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, RedisError):
                if command[0] != "UNLINK":
                    refused = refused or reply
                else:  # a consumed payload's parts: they expire by TTL
                    log.warning("Redis %s: deleting consumed parts failed: %s", self._client.label, reply)
        state.retired = []
        if refused is not None:
            raise refused

    def _inline_commit(self, manifest_key: bytes, marker: bytes, element: bytes) -> bytes:
        """The framed transaction of a small inline put (what ``pack_many`` would make, in one step)."""
        if self._ttl_ms:
            return _INLINE_COMMIT_TTL % (
                len(manifest_key),
                manifest_key,
                len(element),
                element,
                len(manifest_key),
                manifest_key,
                self._ttl_frame,
                len(marker),
                marker,
            )
        return _INLINE_COMMIT % (len(manifest_key), manifest_key, len(element), element, len(marker), marker)

    @staticmethod
    def _check_commit(replies: list[Any]) -> None:
        """Raise the first error of a commit transaction's replies (queuing errors abort EXEC)."""
        for reply in replies[:-1]:
            if isinstance(reply, RedisError):
                raise reply
        results = replies[-1]
        if isinstance(results, RedisError):
            raise results
        if not isinstance(results, list):
            raise ExecAbortError("Transaction discarded")
        for reply in results:
            if isinstance(reply, RedisError):
                raise reply

    def _abandon(self, state: _PutState) -> bool:
        """Best effort after a failed put: withdraw its manifest (if a lost reply hid a commit) and parts.

        The caller was told the put failed, so nothing of it may stay visible. False when the
        server could not be reached (what is left expires by TTL, unless a retry settles it).
        """
        if state.withdrawn:
            return True
        commands = self._abandon_commands(state)

        def step(link: Link) -> None:
            link.send(commands)
            link.read_many(len(commands))

        try:
            self._client.run(state.keys.slot, step, what="put cleanup", key=state.keys.key, retries=1)
        except (ConnectorError, ConnectorClosedError) as exc:
            log.debug("could not withdraw a failed put: %s", exc)
            return False
        return True

    @staticmethod
    def _element_bytes(state: _PutState) -> bytes:
        return state.element if isinstance(state.element, bytes) else state.element.joined()

    def _abandon_commands(self, state: _PutState) -> list[tuple[Any, ...]]:
        """What withdraws a put: its manifest element (if a commit went in), commit marker and parts."""
        keys, manifest = state.keys, state.manifest
        element = self._element_bytes(state)
        doomed = [keys.marker(manifest.put_id), *keys.parts(manifest.put_id, manifest.nparts)]
        # and the consumed parts it had taken over for deletion (other hash tags: one key per delete)
        commands: list[tuple[Any, ...]] = [("LREM", keys.manifest, 0, element), ("UNLINK", *doomed)]
        commands += [("UNLINK", k) for k in state.retired]
        return commands

    # -- get -------------------------------------------------------------------
    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        keys = self._keys(key)
        suspect = self._take_suspect(key)  # taken: no other get of this key reads the same claim
        raw = None if suspect is None else self._recover_claim(keys, suspect)
        if suspect is not None and raw is not None:
            claim_key = suspect
            if mf.looks_inline(raw):
                self._discard(keys, [claim_key], flush=False)
        else:
            claim_key = keys.claim(f"{self._claim_tag}.{next(self._claim_ids):x}")
            try:
                raw = self._claimer.claim(
                    keys, claim_key, timeout, lambda link, element: _drop_inline_claim(link, keys, claim_key, element)
                )
            except ConnectorError:
                self._set_suspect(key, claim_key)  # the move may have run with its reply lost
                raise
            if raw is None:
                return None
        try:
            manifest = mf.parse(raw, self.config.max_payload_bytes)
        except mf.ManifestError as exc:
            self._discard(keys, [claim_key], flush=True)
            raise CorruptPayloadError(f"get {key!r} on Redis {self._client.label}: corrupt manifest (discarded): {exc}") from None
        # one copy either way: the inline bytes (already a fresh bytearray when large), or parts streamed into one buffer
        buffer: bytearray | memoryview | np.ndarray
        if not manifest.inline:
            buffer = self._read_parts(keys, manifest, raw, claim_key)
        elif isinstance(raw, bytearray):
            buffer = memoryview(raw)[mf.HEADER_SIZE :]
        else:
            buffer = bytearray(memoryview(raw)[mf.HEADER_SIZE :])
        return GetResult(wire.decode(buffer, copy=False), manifest.total)

    def _take_suspect(self, key: str) -> bytes | None:
        """The claim list an interrupted get of ``key`` left (None: none), now owned by the caller."""
        if not self._suspect:  # the common case, without the lock
            return None
        with self._suspect_lock:
            return self._suspect.pop(key, None)

    def _set_suspect(self, key: str, claim_key: bytes) -> None:
        """Record the claim list that may still hold ``key``'s payload; the next get of the key looks there first."""
        with self._suspect_lock:
            self._suspect[key] = claim_key

    def _recover_claim(self, keys: PayloadKeys, claim_key: bytes) -> bytes | bytearray | None:
        """A payload an earlier get of this key claimed but never finished reading (None if none)."""
        try:
            found = self._client.run(keys.slot, lambda link: peek_claim(link, claim_key), what="get recover", key=keys.key)
        except ConnectorError:
            self._set_suspect(keys.key, claim_key)
            raise
        if found is not None:
            log.info("get %r on Redis %s: recovered a payload claimed by an earlier, interrupted get", keys.key, self._client.label)
        return found

    def _read_parts(self, keys: PayloadKeys, manifest: mf.Manifest, raw: bytes | bytearray, claim_key: bytes) -> np.ndarray:
        """Stream the parts into one buffer; a payload that cannot be read is deleted (claim list and parts) and reported.

        Nothing sized by the (untrusted) manifest is made before part 0 arrived
        with the announced size: then the payload buffer is allocated, inside
        the ``try``, so no failure leaves the claim list unaccounted for.
        """
        state = _ReadState(keys=keys, manifest=manifest)

        def step(link: Link) -> None:
            try:
                self._read_step(link, state)
            except BaseException:
                if link.aborted and not state.restored:  # close() cut the reads short: give the payload back
                    state.restored = link.send_last(self._restore_commands(keys, raw, claim_key))
                raise
            # every part read: the claim list and the parts go with later writes (see _discard)
            part_keys = keys.parts(manifest.put_id, manifest.nparts)  # as many as parts read: bounded by the bytes received
            if self._reuse_parts:  # the next parted put to this server deletes them one by one (see _write_parts)
                link.defer(keys.slot, "UNLINK", claim_key, frame=frame_key_command("UNLINK", claim_key))
                link.retire(keys.slot, part_keys)
            else:
                link.defer(keys.slot, "UNLINK", claim_key, *part_keys, flush=True)  # frees server memory now

        try:
            self._client.run(keys.slot, step, what="get", key=keys.key)
        except _PartUnusable as exc:
            self._purge(keys, manifest, claim_key)
            raise CorruptPayloadError(f"get {keys.key!r} on Redis {self._client.label}: {exc} (payload discarded)") from None
        except ConnectorError:
            # give it back to the manifest list; if even that fails it stays in our claim list
            if not self._restore(keys, raw, claim_key):
                self._set_suspect(keys.key, claim_key)
            raise
        except BaseException:
            if not state.restored:
                self._set_suspect(keys.key, claim_key)  # e.g. a closed connector: the claim list keeps it (TTL)
            raise
        assert state.buffer is not None  # every part was read, so part 0 was
        return state.buffer

    def _read_step(self, link: Link, state: _ReadState) -> None:
        """Read the remaining parts, keeping ``read_window`` GETs in flight."""
        window = self.config.read_window
        manifest, keys = state.manifest, state.keys
        sent = state.next_part
        total = manifest.nparts
        while state.next_part < total:
            if sent < total and sent - state.next_part < window:
                stop = min(total, state.next_part + window)
                link.send([("GET", keys.part(manifest.put_id, i)) for i in range(sent, stop)])
                sent = stop
            start, stop = manifest.part_span(state.next_part)
            try:
                if state.whole is None:
                    self._read_first_part(link, state, stop - start)
                elif not link.bulk_into(state.whole[start:stop]):
                    raise _PartUnusable(f"part {state.next_part} is missing (expired or deleted)")
            except ProtocolError as exc:  # the link is dropped with the exception: never reused out of step
                raise _PartUnusable(f"part {state.next_part} is corrupt: {exc}") from None
            state.next_part += 1

    @staticmethod
    def _read_first_part(link: Link, state: _ReadState, size: int) -> None:
        """Check part 0's stored size, then allocate the payload buffer and read part 0 into it."""
        found = link.bulk_size()
        if found < 0:
            raise _PartUnusable("part 0 is missing (expired or deleted)")
        if found != size:
            raise ProtocolError(f"stored part is {found} bytes, manifest says {size}")
        total = state.manifest.total
        try:
            # uninitialised (no zero fill), huge pages when large: page faults are most of a fresh buffer's cost
            buffer = empty_bytes(total)
        except MemoryError:  # part 0's body is still unread: the link is dropped with the exception
            raise _PartUnusable(f"the {total} bytes the manifest announces cannot be allocated") from None
        state.buffer, state.whole = buffer, memoryview(buffer.data)
        link.body_into(state.whole[:size])

    def _purge(self, keys: PayloadKeys, manifest: mf.Manifest, claim_key: bytes) -> None:
        """Delete a discarded payload's claim list and every part its manifest names, now.

        The part names are made batch by batch as they are sent (the manifest
        is untrusted; it may announce up to ``max_payload_bytes / MIN_CHUNK_BYTES``
        parts); progress survives retries. What cannot be deleted expires by TTL.
        """
        done = [0]  # commands confirmed so far

        def commands() -> Iterator[tuple[Any, ...]]:
            yield ("UNLINK", claim_key)
            for batch in keys.part_batches(manifest.put_id, manifest.nparts, UNLINK_BATCH):
                yield ("UNLINK", *batch)

        def step(link: Link) -> None:
            _run_pipelined(link, itertools.islice(commands(), done[0], None), done)

        try:
            self._client.run(keys.slot, step, what="get cleanup", key=keys.key)
        except (ConnectorError, ConnectorClosedError) as exc:
            log.warning("%s (keys expire by TTL)", exc)

    def _discard(self, keys: PayloadKeys, doomed: list[bytes], *, flush: bool) -> None:
        """Delete a payload's claim list (and parts); with ``lazy_cleanup`` and no ``flush``, with the next write.

        ``flush`` sends the delete now (a discarded payload: free server memory at once).
        """

        def step(link: Link) -> None:
            link.defer(keys.slot, "UNLINK", *doomed, flush=flush)

        try:
            self._client.run(keys.slot, step, what="get cleanup", key=keys.key)
        except ConnectorClosedError as exc:  # the payload is in hand: the get still returns it
            log.debug("%s (keys expire by TTL)", exc)
        except ConnectorError as exc:
            log.warning("%s (keys expire by TTL)", exc)

    def _restore(self, keys: PayloadKeys, raw: bytes | bytearray, claim_key: bytes) -> bool:
        """Give a claimed payload back (at the head of its list) after reads failed for good.

        One transaction moves it back and deletes the claim list, so the payload is
        never in both. Returns False when the server could not be reached: the payload
        then stays in the claim list, where this connector's next get of the key finds it.
        """
        commands = self._restore_commands(keys, raw, claim_key)

        def step(link: Link) -> None:
            link.send(commands)
            self._check_commit(link.read_many(len(commands)))

        try:
            self._client.run(keys.slot, step, what="get restore", key=keys.key)
        except (ConnectorError, ConnectorClosedError) as exc:
            log.warning("%s; the payload stays claimed and the next get of this key retries it", exc)
            return False
        return True

    def _restore_commands(self, keys: PayloadKeys, raw: bytes | bytearray, claim_key: bytes) -> list[tuple[Any, ...]]:
        commands: list[tuple[Any, ...]] = [("MULTI",), ("LPUSH", keys.manifest, raw)]
        if self._ttl_ms:
            commands.append(("PEXPIRE", keys.manifest, self._ttl_ms))
        return [*commands, ("UNLINK", claim_key), ("EXEC",)]

    # -- existence check (used by the core's wait_any fallback) -------------------
    def _available(self, keys: Sequence[str]) -> list[str] | None:
        """The keys whose manifest list exists now: one pipelined ``EXISTS`` per key, one round trip per server.

        Redis has no blocking wait on several lists that does not pop, so
        ``wait_any`` polls this check with backoff (``capabilities.wait_any`` stays False).
        """
        by_slot: dict[int, list[PayloadKeys]] = {}
        for key in keys:
            try:
                pk = PayloadKeys(self.config.key_prefix, key)
            except ValueError:
                continue
            by_slot.setdefault(pk.slot if self.config.cluster else 0, []).append(pk)
        found: list[str] = []
        for slot, group in by_slot.items():

            def step(link: Link, group: list[PayloadKeys] = group) -> list[str]:
                link.send([("EXISTS", pk.manifest) for pk in group])
                replies = link.read_many(len(group))
                return [pk.key for pk, n in zip(group, replies, strict=True) if n == 1]

            found += self._client.run(slot, step, what="wait_any", key=group[0].key)
        return found

    # -- cleanup / health / close ------------------------------------------------
    def _cleanup(self, key: str) -> bool:
        if self._unsettled:  # a put of this key that failed unsettled: nobody retries it now, withdraw it (marker too)
            with self._unsettled_lock:
                prior = self._unsettled.pop(key, None)
            if prior is not None and not self._abandon(prior):
                with self._unsettled_lock:
                    self._unsettled.setdefault(key, prior)
        keys = self._keys(key)
        # only the claim list of an interrupted get can still hold a payload; others are consumed
        lists = [keys.manifest]
        claim_key = self._take_suspect(key)
        if claim_key is not None:
            lists.append(claim_key)
        commands: list[tuple[Any, ...]] = [("MULTI",), *(("LRANGE", k, 0, -1) for k in lists), ("DEL", *lists), ("EXEC",)]

        def step(link: Link) -> list[bytes | bytearray]:
            link.send(commands)
            replies = link.read_many(len(commands))
            self._check_commit(replies)
            results = replies[-1]
            assert isinstance(results, list)  # checked by _check_commit
            found_lists = results[: len(lists)]
            if not all(isinstance(r, list) for r in found_lists):
                raise ExecAbortError("cleanup transaction discarded")
            elements: list[bytes | bytearray] = [
                e for found in found_lists if isinstance(found, list) for e in found if isinstance(e, bytes | bytearray)
            ]
            manifests: list[mf.Manifest] = []
            for element in elements:
                try:
                    manifests.append(mf.parse(element, self.config.max_payload_bytes))
                except mf.ManifestError:
                    continue
            # part names batch by batch as they are sent: a manifest may announce many parts
            unlinks: Iterator[tuple[Any, ...]] = (
                ("UNLINK", *batch) for m in manifests for batch in keys.part_batches(m.put_id, m.nparts, UNLINK_BATCH)
            )
            _run_pipelined(link, unlinks)
            return elements

        try:
            return bool(self._client.run(keys.slot, step, what="cleanup", key=key))
        except ConnectorError:
            if claim_key is not None:
                self._set_suspect(key, claim_key)
            raise

    def _health(self) -> dict[str, Any]:
        status: dict[str, Any] = {
            "server": self._client.label,
            "cluster": self.config.cluster,
            "sentinel": bool(self.config.sentinels),
            "blocking_get": self._claimer.blocking,
        }
        try:
            nodes = self._client.primaries()
            started = time.perf_counter()
            for slot_owner in nodes:
                self._client.run_on(slot_owner, lambda link: link.call("PING"), what="health check")
            status["nodes"] = len(nodes)
            status["ping_ms"] = round((time.perf_counter() - started) * 1000 / max(len(nodes), 1), 3)
        except (ConnectorError, OSError) as exc:
            status.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        return status

    def _close(self) -> None:
        with self._unsettled_lock:
            unsettled, self._unsettled = list(self._unsettled.values()), {}
        for state in unsettled:  # nobody retries them any more: withdraw what may have gone in
            self._abandon(state)
        self._client.close(wait_replicas=self._wait[1:] if self._wait is not None else None)


class _Body:
    """An encoded payload as every put of it sends it: its buffers, and its parts when too large to go inline.

    Made once per ``put_many``: the keys' puts share the encoder's buffers and
    the parts cut from them, and differ only in their manifests.
    """

    __slots__ = ("buffers", "parts", "small", "total")

    def __init__(self, encoded: wire.Encoded, inline_max: int, chunk_bytes: int) -> None:
        self.total = total = encoded.nbytes
        self.buffers = encoded.buffers()
        #: small inline: the manifest element is one ``bytes`` (header and payload joined), framed in one step
        self.small = total <= SMALL_INLINE_BYTES and total <= inline_max
        self.parts = _split(self.buffers, chunk_bytes) if total > inline_max else None


class _PartUnusable(Exception):
    """A part is missing or has the wrong size: the payload cannot be read (not retried; a :class:`CorruptPayloadError`)."""


def _drop_inline_claim(link: Link, keys: PayloadKeys, claim_key: bytes, element: bytes | bytearray) -> None:
    """Right after a claim: an inline payload is in hand, so its claim list's delete rides on the next write."""
    if mf.looks_inline(element):
        link.defer(keys.slot, "UNLINK", claim_key, frame=frame_key_command("UNLINK", claim_key))


def _reply(link: Link, command: tuple[Any, ...]) -> Any:
    """One command on ``link``, its reply (an error reply raised)."""
    return link.call(*command)


def _int_reply(reply: Any) -> int:
    if not isinstance(reply, int):
        raise ResponseError(f"expected an integer reply, got {type(reply).__name__}")
    return reply


def _run_pipelined(link: Link, commands: Iterator[tuple[Any, ...]], done: list[int] | None = None) -> None:
    """Send ``commands`` ``UNLINK_PIPELINE`` per round trip, made group by group; an error reply is raised.

    ``done[0]`` counts the commands confirmed (where a retry resumes).
    """
    while group := list(itertools.islice(commands, UNLINK_PIPELINE)):
        link.send(group)
        for reply in link.read_many(len(group)):
            if isinstance(reply, RedisError):
                raise reply
        if done is not None:
            done[0] += len(group)


def _split(buffers: list[memoryview], chunk: int) -> list[list[Buffer]]:
    """Cut a sequence of buffers into consecutive runs of ``chunk`` bytes (views, no copies)."""
    parts: list[list[Buffer]] = []
    current: list[Buffer] = []
    room = chunk
    for buf in buffers:
        view = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        while view.nbytes:
            take = min(room, view.nbytes)
            current.append(view[:take])
            view = view[take:]
            room -= take
            if room == 0:
                parts.append(current)
                current, room = [], chunk
    if current:
        parts.append(current)
    return parts
