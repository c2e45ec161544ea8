"""``KVTransferManager``: moves per-request KV shards between two TP stages over a connector.

One manager lives in each model-runner process (one per TP rank). On the
sending stage it extracts a finished request's KV from the paged caches and
puts one shard per target rank; on the receiving stage it gets the shards of
every source rank, merges or slices them to this rank's heads and hands the
payload to the runner. Routing and keys: :mod:`omni_plugins.kv.ranks`.

Keys use ``stage_id`` as the from-stage when sending and ``from_stage`` when
receiving; the chunk index is always 0 (a request's KV is sent once; sending
it again replaces the earlier shard).

Thread safety: sends, receives and cleanups may run on different threads; the
per-request state is guarded by one lock that is never held across connector I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from omni_plugins.backoff import Backoff
from omni_plugins.config import RankMapping
from omni_plugins.contract import Connector, failed_put
from omni_plugins.errors import ConfigError, ConnectorClosedError, ConnectorError, OmniPluginsError, WireFormatError
from omni_plugins.kv import ranks
from omni_plugins.kv.errors import KVPayloadError
from omni_plugins.kv.layout import LAYOUTS, KVLayout, normalize_caches
from omni_plugins.kv.payload import KVPayload, make_payload, payload_to_device, validate_payload
from omni_plugins.kv.shards import merge_shards, slice_for_rank

logger = logging.getLogger(__name__)

KV_CHUNK = 0
"""Chunk index used in every KV key (a request's KV moves as one chunk)."""

#: first wait before retrying a failed KV put; doubles per attempt up to ``_PUT_BACKOFF_MAX_S``
_PUT_BACKOFF_S = 0.05
_PUT_BACKOFF_MAX_S = 1.0
#: first wait after a failed KV read; doubles per failure up to ``_GET_BACKOFF_MAX_S``, never past the receive's deadline
_GET_BACKOFF_S = 0.002
_GET_BACKOFF_MAX_S = 0.05


@dataclass(frozen=True)
class _Shard:
    key: str
    payload: KVPayload
    size: int


@dataclass
class _RequestKV:
    """Everything this manager holds for one request.

    ``request_id`` is the id the caller used (the runner's internal id on the
    send side); ``external_id`` is the id in the keys. ``sent_keys`` are shards
    this rank put and may still sit in the backend; ``partial`` are shards
    already consumed by a receive that has not completed (``keep_partial``).
    """

    request_id: str
    external_id: str
    sent_keys: set[str] = field(default_factory=set)
    partial: dict[int, _Shard] = field(default_factory=dict)

    def matches(self, rid: str) -> bool:
        return rid in (self.request_id, self.external_id)


def distinct_head_sources(sources: list[int], head_replicas: int) -> list[int]:
    """The sender ranks whose shards to merge: one per distinct KV head, in rank order.

    With fewer KV heads than sender ranks (GQA), sender rank ``s`` holds head
    ``s // head_replicas``: consecutive ranks hold copies, and merging them all would
    repeat heads. Every shard is still taken from the connector, so none is left behind.
    """
    if head_replicas <= 1:
        return list(sources)
    kept: list[int] = []
    heads: set[int] = set()
    for src in sources:
        if src // head_replicas not in heads:
            heads.add(src // head_replicas)
            kept.append(src)
    return kept


class KVTransferManager:
    """Send and receive rank-sharded KV caches for one stage rank.

    Args:
        connector: the connector to move shards over (owned by the caller; not
            closed by :meth:`close`). ``None`` makes sends no-ops and receives empty.
        stage_id: this stage; the from-stage in keys this rank sends.
        from_stage: the stage KV is received from (from-stage in receive keys).
        to_stage: the stage KV is sent to (informational, passed to ``put``).
        rank_mapping: TP sizes of the KV edge (``from_tp`` senders, ``to_tp`` receivers).
        local_rank: this process's TP rank: a sender rank when sending, a
            receiver rank when receiving.
        recv_timeout_s: default deadline of one receive (all shards together).
        layout: paged-cache layout for extraction (``"auto"``, ``"nhd"``, ``"hnd"``,
            see :mod:`omni_plugins.kv.layout`); can be overridden per send.
        put_attempts: attempts per shard ``put`` before the request's send fails.
        send_key_stage: the sending stage's part of the keys this rank puts (default
            ``stage_id``; a fanning-out sender's edges key ``{from}-{to}``, see
            :mod:`omni_plugins.config.topology`).
        recv_key_stage: the sending stage's part of the keys this rank reads
            (default ``from_stage``).
        destinations: every KV output edge this manager sends on, as
            ``(to_stage, key_stage)`` (default: ``[(to_stage, send_key_stage)]``).
            A fanning-out stage whose KV edges share a connector sends through
            one manager: each request's KV is extracted once and put under the
            keys of every edge with one ``put_many`` (encoded once where the
            backend can).
        receives: this manager may receive (False: a send-only manager; its
            cleanup does not look for shards addressed to this rank).
    """

    def __init__(
        self,
        connector: Connector | None,
        *,
        stage_id: int,
        from_stage: int,
        to_stage: int,
        rank_mapping: RankMapping | Mapping[str, int] | None = None,
        local_rank: int = 0,
        recv_timeout_s: float = 30.0,
        layout: KVLayout = "auto",
        put_attempts: int = 3,
        send_key_stage: str | None = None,
        recv_key_stage: str | None = None,
        receives: bool = True,
        destinations: Sequence[tuple[int, str]] | None = None,
    ) -> None:
        if rank_mapping is None:
            rank_mapping = RankMapping()
        elif not isinstance(rank_mapping, RankMapping):
            try:
                rank_mapping = RankMapping(**dict(rank_mapping))
            except Exception as exc:
                raise ConfigError(f"KV transfer (stage {stage_id}): invalid rank_mapping {rank_mapping!r}: {exc}") from exc
        ranks.validate_topology(rank_mapping.from_tp, rank_mapping.to_tp, local_rank)
        if not recv_timeout_s >= 0:
            raise ConfigError(f"KV transfer (stage {stage_id}): recv_timeout_s must be >= 0, got {recv_timeout_s!r}")
        if layout not in LAYOUTS:
            raise ConfigError(f"KV transfer (stage {stage_id}): layout must be one of {LAYOUTS}, got {layout!r}")
        if put_attempts < 1:
            raise ConfigError(f"KV transfer (stage {stage_id}): put_attempts must be >= 1, got {put_attempts!r}")
        self._connector = connector
        self.stage_id = stage_id
        self.from_stage = from_stage
        self.to_stage = to_stage
        self._send_key_stage = send_key_stage if send_key_stage is not None else str(stage_id)
        self._destinations: list[tuple[int, str]] = list(destinations) if destinations is not None else [(to_stage, self._send_key_stage)]
        if not self._destinations:
            raise ConfigError(f"KV transfer (stage {stage_id}): destinations must not be empty")
        self._recv_key_stage = recv_key_stage if recv_key_stage is not None else str(from_stage)
        self._receives = receives
        self.from_tp = rank_mapping.from_tp
        self.to_tp = rank_mapping.to_tp
        #: with ``num_kv_heads``, replicated GQA heads: a merge keeps one copy of each, a slice keeps the replicated head
        self.rank_mapping = rank_mapping
        self.local_rank = local_rank
        self.recv_timeout_s = float(recv_timeout_s)
        self.layout: KVLayout = layout
        self._put_attempts = put_attempts
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestKV] = {}
        self._failed_sends: list[str] = []
        self._closed = False

    # -- introspection -----------------------------------------------------
    @property
    def connector(self) -> Connector | None:
        return self._connector

    def tracked_request_ids(self) -> list[str]:
        """Ids of requests this manager still holds state for (empty after cleanup: leak checks)."""
        with self._lock:
            return sorted(self._requests)

    def drain_failed_sends(self) -> list[str]:
        """Request ids whose KV could not be sent since the last call (each logged at ERROR)."""
        with self._lock:
            failed, self._failed_sends = self._failed_sends, []
        return failed

    def send_keys(self, request_id: str) -> list[str]:
        """Keys this rank puts for ``request_id`` (external id): one per destination edge and target rank."""
        targets = ranks.target_ranks_for_send(self.from_tp, self.to_tp, self.local_rank)
        return [key for _, key in self._send_targets(request_id, targets)]

    def _send_targets(self, external_id: str, targets: list[int]) -> list[tuple[int, str]]:
        """``(to_stage, key)`` of every shard this rank puts for a request: per destination edge, per target rank."""
        return [
            (to_stage, ranks.kv_key(external_id, key_stage, KV_CHUNK, self.local_rank, t))
            for to_stage, key_stage in self._destinations
            for t in targets
        ]

    def recv_keys(self, request_id: str) -> list[str]:
        """Keys this rank reads for ``request_id``, in source-rank (= head) order."""
        sources = ranks.remote_ranks_for_recv(self.from_tp, self.to_tp, self.local_rank)
        return [ranks.kv_key(request_id, self._recv_key_stage, KV_CHUNK, s, self.local_rank) for s in sources]

    # -- send ----------------------------------------------------------------
    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: Mapping[str, Mapping[str, Any]],
        kv_caches: Any,
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
        *,
        layout: KVLayout | None = None,
    ) -> list[str]:
        """Extract and send the KV of finished requests; return the ids that are done.

        ``finished_reqs`` maps the runner's request id to ``{"seq_len": int,
        "block_ids": [int, ...], "custom_metadata": {...}?}``; ``kv_caches`` is
        one of the forms in :mod:`omni_plugins.kv.layout`. The payload is put
        under ``{external_id}_{stage_id}_0_{local_rank}_{target}`` for every
        target rank (the full shard to each; receivers narrow it) and every
        destination edge, with one ``put_many`` (encoded once where the backend
        can), where ``external_id = request_id_resolver(id)`` (or the id itself).

        The returned ids are the requests whose transfer is finished -- sent, or
        failed for good (logged at ERROR and reported by
        :meth:`drain_failed_sends`) -- so the caller can release their blocks in
        both cases. A failed request leaves no shard behind.

        Raises :class:`~omni_plugins.kv.errors.KVLayoutError` (before anything is
        sent) when the caches cannot be read.
        """
        self._check_open()
        if not finished_reqs:
            return []
        if self._connector is None:
            return list(finished_reqs)
        targets = ranks.target_ranks_for_send(self.from_tp, self.to_tp, self.local_rank)
        caches = normalize_caches(kv_caches, block_size, layout or self.layout)
        done: list[str] = []
        for req_id, info in finished_reqs.items():
            try:
                external_id = request_id_resolver(req_id) if request_id_resolver is not None else req_id
                payload = self._extract(external_id, info, caches, block_size, cache_dtype)
            except KVPayloadError as exc:
                logger.error("KV send (stage %s rank %s): request %s skipped: %s", self.stage_id, self.local_rank, req_id, exc)
                self._record_failed(req_id)
                done.append(req_id)
                continue
            except Exception:  # a resolver or torch failure must not strand the rest of the batch
                logger.exception("KV send (stage %s rank %s): request %s failed", self.stage_id, self.local_rank, req_id)
                self._record_failed(req_id)
                done.append(req_id)
                continue
            if self._put_all(req_id, external_id, self._send_targets(external_id, targets), payload):
                done.append(req_id)
            else:
                self._record_failed(req_id)
                done.append(req_id)
        return done

    def _extract(self, external_id: str, info: Mapping[str, Any], caches: Any, block_size: int, cache_dtype: str) -> KVPayload:
        if not isinstance(info, Mapping):
            raise KVPayloadError(f"request info must be a dict with seq_len and block_ids, got {type(info).__name__}")
        seq_len, block_ids = info.get("seq_len"), info.get("block_ids")
        if block_ids is None:
            raise KVPayloadError("request info has no block_ids")
        keys, values = caches.gather(block_ids, seq_len)
        custom = info.get("custom_metadata") or {}
        if not isinstance(custom, Mapping):
            raise KVPayloadError(f"custom_metadata must be a dict, got {type(custom).__name__}")
        # Routing fields win over custom metadata with the same name.
        metadata: dict[str, Any] = dict(custom)
        metadata.update(
            request_id=external_id,
            seq_len=next(int(t.shape[0]) for t in keys if t is not None),
            block_size=block_size,
            num_layers=len(keys),
            cache_dtype=str(cache_dtype),
            layout=caches.layout,
            from_stage=self.stage_id,
            from_rank=self.local_rank,
            from_tp=self.from_tp,
            to_tp=self.to_tp,
        )
        return make_payload(keys, values, metadata)

    def _put_all(self, req_id: str, external_id: str, targets: list[tuple[int, str]], payload: KVPayload) -> bool:
        """Put ``payload`` under every ``(to_stage, key)`` (all or nothing: on a failure the ones already put are withdrawn).

        One ``put_many`` per attempt; an attempt retries only the keys that failed.
        """
        connector = self._connector
        assert connector is not None
        put: list[str] = []
        pending = targets
        backoff = Backoff(_PUT_BACKOFF_S, _PUT_BACKOFF_MAX_S)
        for attempt in range(1, self._put_attempts + 1):
            try:
                results = connector.put_many([(self.stage_id, to_stage, key) for to_stage, key in pending], payload)
            except Exception as exc:  # plugin boundary: nothing of this attempt was stored
                results = [failed_put(exc)] * len(pending)
            failed: list[tuple[int, str]] = []
            final = False
            for target, result in zip(pending, results, strict=True):
                if result.ok:
                    logger.debug("KV put %s (%d bytes)", target[1], result.size)
                    put.append(target[1])
                    continue
                failed.append(target)
                meta = result.metadata or {}
                final = final or isinstance(meta.get("exception"), ConnectorClosedError | WireFormatError)  # retrying cannot help
                reason = meta.get("error", "put returned ok=False")
            pending = failed
            if not pending:
                break
            keys = ", ".join(key for _, key in pending)
            if final:
                logger.error("KV put %s failed: %s", keys, reason)
                break
            if attempt < self._put_attempts:
                logger.warning("KV put %s failed (attempt %d/%d): %s; retrying", keys, attempt, self._put_attempts, reason)
                backoff.sleep()
            else:
                logger.error("KV put %s failed after %d attempts: %s", keys, attempt, reason)
        if pending:
            for k in put:
                self._cleanup_key(connector, k)
            return False
        with self._lock:
            state = self._requests.get(req_id)
            if state is None:
                state = self._requests[req_id] = _RequestKV(req_id, external_id)
            state.external_id = external_id
            state.sent_keys.update(put)
        return True

    def _record_failed(self, req_id: str) -> None:
        with self._lock:
            self._failed_sends.append(req_id)

    # -- receive -------------------------------------------------------------
    def receive_kv_cache_for_request(
        self,
        request_id: str,
        target_device: torch.device | str | None = None,
        *,
        timeout_s: float | None = None,
        keep_partial: bool = False,
    ) -> tuple[KVPayload | None, int]:
        """Receive this rank's KV for ``request_id``: ``(payload, total bytes)`` or ``(None, 0)``.

        Gets the shard of every source rank (in head order) within one deadline
        (``timeout_s``, default ``recv_timeout_s``; ``0`` = only what is already
        there), using the connector's blocking ``get(timeout=)``. Several shards
        are merged on the head dim (``metadata["merged_remote_rank_count"]``);
        with ``from_tp < to_tp`` the shard is narrowed to this rank's heads
        (``metadata["sliced_for_local_rank"]``). Tensors are moved to
        ``target_device`` when given.

        On timeout, shards already consumed are dropped (nothing is left in the
        backend or here) -- unless ``keep_partial`` is true, in which case they
        are kept for the next call with the same id (for callers that poll with
        short timeouts) and freed by :meth:`cleanup` / :meth:`close`. A read
        that fails with ``ConnectorError`` is retried until the deadline and
        then counts as a timeout (the backend keeps the shard). A closed
        connector and undecodable or malformed shards are logged and give
        ``(None, 0)``.
        """
        self._check_open()
        deadline = time.monotonic() + (self.recv_timeout_s if timeout_s is None else max(0.0, float(timeout_s)))
        return self._receive(request_id, target_device, deadline, keep_partial)

    def _receive(
        self, request_id: str, target_device: torch.device | str | None, deadline: float, keep_partial: bool
    ) -> tuple[KVPayload | None, int]:
        connector = self._connector
        if connector is None:
            return None, 0
        sources = ranks.remote_ranks_for_recv(self.from_tp, self.to_tp, self.local_rank)
        with self._lock:
            state = self._find(request_id)
            shards: dict[int, _Shard] = dict(state.partial) if state is not None else {}
            if state is not None:
                state.partial.clear()
                self._forget_if_empty(state)
        for src in sources:
            if src in shards:
                continue
            key = ranks.kv_key(request_id, self._recv_key_stage, KV_CHUNK, src, self.local_rank)
            try:
                shard = self._get_shard(connector, key, deadline)
                if shard is not None:
                    self._check_routing(shard, request_id, src)
            except OmniPluginsError as exc:  # ConnectorClosedError, WireFormatError, KVPayloadError: retrying cannot help
                logger.error("KV receive %s (stage %s rank %s): %s", request_id, self.stage_id, self.local_rank, exc)
                return None, 0
            except Exception:  # plugin boundary: a plugin's own bug must not kill the caller's thread
                logger.exception("KV receive %s (stage %s rank %s): get of %s failed", request_id, self.stage_id, self.local_rank, key)
                return None, 0
            if shard is None:
                if keep_partial and shards:
                    with self._lock:
                        st = self._find(request_id) or self._requests.setdefault(request_id, _RequestKV(request_id, request_id))
                        st.partial.update(shards)
                elif shards:
                    logger.warning(
                        "KV receive %s: timed out waiting for %s after %d of %d shards; dropping them",
                        request_id,
                        key,
                        len(shards),
                        len(sources),
                    )
                logger.info("KV receive %s (stage %s rank %s): timed out waiting for %s", request_id, self.stage_id, self.local_rank, key)
                return None, 0
            shards[src] = shard
        try:
            ordered = [shards[s].payload for s in distinct_head_sources(sources, self.rank_mapping.head_replicas)]
            payload = merge_shards(ordered) if len(ordered) > 1 else ordered[0]
            replicated = self.rank_mapping.num_kv_heads is not None
            payload = slice_for_rank(payload, self.from_tp, self.to_tp, self.local_rank, replicated_heads=replicated)
            payload = payload_to_device(payload, target_device)
        except KVPayloadError as exc:
            logger.error("KV receive %s: cannot combine shards: %s", request_id, exc)
            return None, 0
        total = sum(s.size for s in shards.values())
        logger.debug("KV receive %s: %d shard(s), %d bytes", request_id, len(shards), total)
        return payload, total

    def _get_shard(self, connector: Connector, key: str, deadline: float) -> _Shard | None:
        """Read one shard by ``deadline`` (None: it did not come in time).

        A failed read (``ConnectorError``, e.g. Mooncake's transfer engine
        while a peer's segment is still being set up) is retried until the
        deadline: the backend still holds the shard, and giving up would also
        drop the shards of other ranks this receive already consumed. Errors
        retrying cannot mend (a closed connector, an undecodable or malformed
        shard) raise.
        """
        backoff = Backoff(_GET_BACKOFF_S, _GET_BACKOFF_MAX_S, deadline)
        failures = 0
        while True:
            try:
                result = connector.get(self.from_stage, self.stage_id, key, timeout=backoff.remaining())
            except ConnectorError as exc:
                failures += 1
                if failures == 1 and backoff.remaining() > 0:
                    logger.warning("KV receive: read of %s failed (%s); retrying until the deadline", key, exc)
                if not backoff.sleep():
                    logger.warning("KV receive: read of %s failed %d time(s) before the deadline, last: %s", key, failures, exc)
                    return None
                continue
            if result is None:
                return None
            if not connector.capabilities.consume_on_get:
                self._cleanup_key(connector, key)  # read once, like a consuming backend
            return _Shard(key, validate_payload(result.data, f"KV shard {key}"), int(result.size))

    def _check_routing(self, shard: _Shard, request_id: str, src: int) -> None:
        """Raise :class:`KVPayloadError` when a shard's routing metadata contradicts its key.

        A shard is only trusted to hold the heads its key promises: one written
        for another request, by another sender rank or under another TP mapping
        would be merged or sliced into the wrong heads without a shape error.
        Its ``num_layers`` and ``seq_len`` must match the tensors it carries.
        Fields absent from the metadata are not checked.
        """
        meta = shard.payload["metadata"]
        expected: dict[str, Any] = {"request_id": request_id, "from_rank": src, "from_tp": self.from_tp, "to_tp": self.to_tp}
        wrong = {name: meta[name] for name, want in expected.items() if name in meta and meta[name] != want}
        if wrong:
            raise KVPayloadError(f"KV shard {shard.key}: metadata {wrong} contradicts the key and this rank's mapping {expected}")
        layers = shard.payload["layer_blocks"]["key_cache"]
        if "num_layers" in meta and meta["num_layers"] != len(layers):
            raise KVPayloadError(f"KV shard {shard.key}: metadata num_layers={meta['num_layers']!r} but the shard has {len(layers)} layers")
        if "seq_len" in meta:
            tokens = {int(t.shape[0]) for t in layers if t is not None and t.ndim >= 3}
            if tokens and tokens != {meta["seq_len"]}:
                raise KVPayloadError(
                    f"KV shard {shard.key}: metadata seq_len={meta['seq_len']!r} but its layers hold {sorted(tokens)} tokens"
                )

    def receive_cfg_companion(
        self, cfg_request_ids: Mapping[str, str], target_device: torch.device | str | None = None, *, timeout_s: float | None = None
    ) -> dict[str, tuple[KVPayload | None, int]]:
        """Receive the KV of CFG companion requests, ``{role: request_id}`` -> ``{role: (payload | None, size)}``.

        All roles share one deadline, so a missing companion costs one timeout, not one per role.
        """
        self._check_open()
        deadline = time.monotonic() + (self.recv_timeout_s if timeout_s is None else max(0.0, float(timeout_s)))
        return {role: self._receive(rid, target_device, deadline, False) for role, rid in cfg_request_ids.items()}

    @staticmethod
    def apply_kv_cache_to_request(req: Any, data: Mapping[str, Any]) -> None:
        """Attach a received payload to a request object.

        Sets ``req.past_key_values`` (a namespace with ``key_cache`` and
        ``value_cache`` per-layer lists), ``req.kv_metadata`` and
        ``req.kv_payload`` (the payload itself); when the request has a non-None
        ``sampling_params`` its ``past_key_values`` and ``kv_metadata`` are set
        too. Raises :class:`KVPayloadError` for a malformed payload.
        """
        payload = validate_payload(data)
        kv = SimpleNamespace(**payload["layer_blocks"])
        req.past_key_values = kv
        req.kv_metadata = payload["metadata"]
        req.kv_payload = payload
        params = getattr(req, "sampling_params", None)
        if params is not None:
            params.past_key_values = kv
            params.kv_metadata = payload["metadata"]

    # -- lifecycle -----------------------------------------------------------
    def cleanup(self, request_id: str, *, drop_sent: bool = True) -> int:
        """Free everything this rank holds or may receive for ``request_id``; return keys freed.

        Deletes from the connector the shards this rank put for the request
        (unless ``drop_sent`` is false -- use that when the request finished
        normally and the receiver has yet to read them) and the shards addressed
        to this rank (late arrivals after a timeout), drops partial shards kept
        by ``keep_partial`` and forgets the request. Accepts the internal or the
        external id. Connector errors are logged, not raised.
        """
        with self._lock:
            state = self._find(request_id)
            if state is not None:
                del self._requests[state.request_id]
        keys: set[str] = set()
        ids = {request_id}
        if state is not None:
            ids.add(state.external_id)
            if drop_sent:
                keys |= state.sent_keys
            keys |= {s.key for s in state.partial.values()}
        if self._receives and 0 <= self.local_rank < self.to_tp:
            for rid in ids:
                keys.update(self.recv_keys(rid))
        connector = self._connector
        if connector is None or connector.closed:
            return 0
        return sum(self._cleanup_key(connector, k) for k in sorted(keys))

    def close(self) -> None:
        """Free every tracked request's shards (sent and partial) and forget them. Idempotent.

        The connector itself is not closed: it belongs to the caller.
        """
        with self._lock:
            if self._closed:
                return
            ids = list(self._requests)
        for rid in ids:
            self.cleanup(rid)
        with self._lock:
            self._closed = True
            self._requests.clear()
            self._failed_sends.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> KVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------
    def _find(self, rid: str) -> _RequestKV | None:
        state = self._requests.get(rid)
        if state is not None:
            return state
        return next((s for s in self._requests.values() if s.matches(rid)), None)

    def _forget_if_empty(self, state: _RequestKV) -> None:
        if not state.sent_keys and not state.partial:
            self._requests.pop(state.request_id, None)

    def _cleanup_key(self, connector: Connector, key: str) -> bool:
        try:
            return bool(connector.cleanup(key))
        except Exception as exc:  # plugin boundary; cleanup is best effort
            logger.warning("KV cleanup of %s failed: %s: %s", key, type(exc).__name__, exc)
            return False

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError(f"KV transfer manager of stage {self.stage_id} rank {self.local_rank} is closed")
