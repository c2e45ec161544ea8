"""``StageTransferRuntime``: the data plane of one stage rank.

A thin composition: :mod:`~omni_plugins.runtime.state` (one object per
request), :mod:`~omni_plugins.runtime.sender` and
:mod:`~omni_plugins.runtime.receiver` (the two I/O threads),
:mod:`~omni_plugins.runtime.delivery` (receive-side rules),
:mod:`~omni_plugins.runtime.accumulate` (full-payload and chunk merging),
:mod:`~omni_plugins.runtime.tp` (rank-0 fan-out) and
:mod:`~omni_plugins.runtime.kvbridge` (KV). Method names follow the reference
runtime so a model runner written against it can switch.

The model thread never calls ``put``/``get``; it calls the methods below once
per step and forwards :meth:`collect_signals` to its scheduler.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from omni_plugins.config.models import PipelineConfig, RankMapping, StageConfig, StageConnectorConfig
from omni_plugins.contract import Connector
from omni_plugins.errors import ConfigError, OmniPluginsError
from omni_plugins.factory import create_connector, format_validation_error
from omni_plugins.payload import ResolvedBuilder, resolve_stage_builder
from omni_plugins.runtime.accumulate import FullPayloadAccumulator
from omni_plugins.runtime.backlog import CleanupBacklog
from omni_plugins.runtime.compat import CodePromptView, PutChunkView, RequestPayloadView
from omni_plugins.runtime.delivery import Delivery
from omni_plugins.runtime.kvbridge import KVBridge
from omni_plugins.runtime.receiver import Receiver
from omni_plugins.runtime.sender import Sender
from omni_plugins.runtime.signals import ConnectorSignals
from omni_plugins.runtime.snapshot import snapshot_payload
from omni_plugins.runtime.state import RequestRegistry, RequestState
from omni_plugins.runtime.tp import SingleRankGroup, TPGroup
from omni_plugins.runtime.tuning import RuntimeTuning

logger = logging.getLogger(__name__)


def _request_id(request: Any) -> str:
    rid = getattr(request, "request_id", None) or getattr(request, "req_id", None)
    if rid is None:
        raise TypeError(f"request {type(request).__name__} has neither request_id nor req_id")
    return str(rid)


def _external_id(request: Any, fallback: str) -> str:
    """``request.external_req_id``, falling back to the request id (also for an explicit None)."""
    ext = getattr(request, "external_req_id", None) if request is not None else None
    return str(ext) if ext is not None else fallback


def _request_finished(request: Any, default: bool) -> bool:
    fn = getattr(request, "is_finished", None)
    if callable(fn):
        try:
            return bool(fn())
        except Exception:
            logger.debug("request.is_finished() raised", exc_info=True)
    return default


class StageTransferRuntime:
    """The transfer runtime of one stage rank.

    Args:
        stage_config: the stage (ids, mode, builder paths, timeouts).
        connector_config: the stage's connector (``{name, extra, to_stage?,
            rank_mapping?}`` or a :class:`StageConnectorConfig`); ``None`` and no
            ``connector`` means no transfers: sends are no-ops, nothing is
            received, no threads run.
        connector: an already created connector (closed by :meth:`shutdown`
            unless ``close_connector=False``).
        kv_manager: the KV transfer manager; created from
            :mod:`omni_plugins.kv` when the stage has ``kv_transfer`` and a connector.
        tp_group: this stage's TP group (default: a single rank).
        local_rank: this rank for KV routing (default: the TP rank, else ``LOCAL_RANK``).
        tuning: I/O thread knobs.
    """

    def __init__(
        self,
        stage_config: StageConfig,
        connector_config: StageConnectorConfig | Mapping[str, Any] | None = None,
        *,
        connector: Connector | None = None,
        kv_manager: Any | None = None,
        tp_group: TPGroup | None = None,
        local_rank: int | None = None,
        tuning: RuntimeTuning | None = None,
        close_connector: bool = True,
    ) -> None:
        self.stage_config = stage_config
        self.stage_id = stage_config.stage_id
        self.tuning = tuning or RuntimeTuning()
        self.connector_config = self._validate_connector_config(connector_config)
        cfg = self.connector_config
        if connector is None and cfg is not None:
            connector = self._create_connector(cfg)
        self._connector = connector
        self._close_connector = close_connector
        self.async_chunk = stage_config.async_chunk
        self.worker_type = stage_config.worker_type
        self.next_stage_id = cfg.to_stage if cfg is not None and cfg.to_stage is not None else self.stage_id + 1
        inputs = stage_config.input_stages()
        self.from_stage = next(iter(inputs)) if len(inputs) == 1 else self.stage_id - 1
        self.rank_mapping: RankMapping = (cfg.rank_mapping if cfg is not None else None) or stage_config.rank_mapping or RankMapping()
        self.tp: TPGroup = tp_group if tp_group is not None else SingleRankGroup()
        self.local_rank = self._resolve_local_rank(local_rank)
        if stage_config.tp_size > 1 and self.tp.world_size == 1:
            logger.warning(
                "stage %s has tp_size=%s but no TP group was given: ranks will not share payloads", self.stage_id, stage_config.tp_size
            )

        self.builder: ResolvedBuilder | None = None
        if connector is not None:
            self.builder = resolve_stage_builder(
                stage_config.custom_process_next_stage_input_func,
                stage_config.custom_process_input_func,
                full_payload=not self.async_chunk,
            )
        # the accumulation gate is structural: decide once
        self._accumulate = bool(
            stage_config.custom_process_next_stage_input_func
            and not self.async_chunk
            and not stage_config.final_output
            and stage_config.model_stage is not None
            and connector is not None
        )

        self._registry = RequestRegistry()
        self._lock = self._registry.lock
        multi = self.tp.world_size > 1
        self._delivery = Delivery(
            self._registry,
            from_stage=self.from_stage,
            async_chunk=self.async_chunk,
            worker_type=self.worker_type,
            recv_timeout_s=stage_config.recv_timeout_s,
            abort_scan_limit=self.tuning.abort_scan_limit,
            multi_rank=multi,
        )
        self._owns_kv = False
        if kv_manager is None and stage_config.kv_transfer and connector is not None:
            from omni_plugins.kv import KVTransferManager

            kv_manager = KVTransferManager(
                connector,
                stage_id=self.stage_id,
                from_stage=self.from_stage,
                to_stage=self.next_stage_id,
                rank_mapping=self.rank_mapping,
                local_rank=self.local_rank,
                recv_timeout_s=stage_config.recv_timeout_s,
                layout=stage_config.kv_layout,
            )
            self._owns_kv = True
        self._kv = KVBridge(
            self._registry, kv_manager, from_tp=self.rank_mapping.from_tp, to_tp=self.rank_mapping.to_tp, local_rank=self.local_rank
        )

        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        #: key scans a backend error cut short (timeouts, aborts), retried at shutdown
        self._cleanup_backlog = CleanupBacklog()
        self._closed = False
        if connector is not None:
            tag = f"stage{self.stage_id}-r{self.local_rank}"
            self._sender = Sender(
                connector,
                self._registry,
                from_stage=self.stage_id,
                to_stage=self.next_stage_id,
                max_retries=self.tuning.max_send_retries,
                retry_backoff_s=self.tuning.retry_backoff_s,
                handoff_s=self.tuning.send_handoff_s,
                name=f"omni-send-{tag}",
            )
            if self.is_data_transfer_rank() and self.stage_id > 0:
                self._receiver = Receiver(
                    connector,
                    self._registry,
                    self._delivery,
                    from_stage=self.from_stage,
                    to_stage=self.stage_id,
                    tuning=self.tuning,
                    name=f"omni-recv-{tag}",
                    cleanup_backlog=self._cleanup_backlog,
                )
        logger.info(
            "stage %s runtime: connector=%s async_chunk=%s worker=%s next_stage=%s builder=%s arrival=%s",
            self.stage_id,
            getattr(connector, "name", None),
            self.async_chunk,
            self.worker_type,
            self.next_stage_id,
            self.builder.path if self.builder else None,
            self._receiver.mode if self._receiver else None,
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pipeline(cls, pipeline_config: PipelineConfig, stage_id: int, **kwargs: Any) -> StageTransferRuntime:
        """The runtime of ``stage_id`` in a validated pipeline."""
        return cls(pipeline_config.stage(stage_id), pipeline_config.stage_connector_config(stage_id), **kwargs)

    def _validate_connector_config(self, cfg: StageConnectorConfig | Mapping[str, Any] | None) -> StageConnectorConfig | None:
        if cfg is None or isinstance(cfg, StageConnectorConfig):
            return cfg
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"stage {self.stage_id}: stage_connector_config must be a mapping, got {type(cfg).__name__}")
        try:
            return StageConnectorConfig.model_validate(dict(cfg))
        except ValidationError as exc:
            where = f"stage {self.stage_id}: stage_connector_config"
            raise ConfigError(f"invalid {where}: {format_validation_error(exc, prefix='stage_connector_config')}") from None

    def _create_connector(self, cfg: StageConnectorConfig) -> Connector:
        try:
            return create_connector(cfg.name, cfg.extra)
        except OmniPluginsError as exc:
            raise ConfigError(f"stage {self.stage_id}: cannot create connector {cfg.name!r}: {exc}") from exc

    def _resolve_local_rank(self, explicit: int | None) -> int:
        if explicit is not None:
            value: Any = explicit
        elif self.tp.world_size > 1:
            value = self.tp.rank_in_group
        else:
            raw = os.environ.get("LOCAL_RANK", "0").strip() or "0"
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"stage {self.stage_id}: LOCAL_RANK={raw!r} is not an integer") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"stage {self.stage_id}: local rank must be a non-negative int, got {value!r}")
        return value

    # ------------------------------------------------------------------ properties
    @property
    def connector(self) -> Connector | None:
        return self._connector

    @property
    def kv_manager(self) -> Any | None:
        return self._kv.manager

    @property
    def arrival_mode(self) -> str | None:
        """``"block"`` or ``"poll"`` on the rank that receives; None elsewhere."""
        return self._receiver.mode if self._receiver else None

    def should_accumulate_full_payload_output(self) -> bool:
        """The (cached) accumulation gate: explicit next-stage builder, full-payload mode,
        not the final-output stage, a model stage, and a connector."""
        return self._accumulate

    def is_data_transfer_rank(self) -> bool:
        """Only TP rank 0 moves ordinary (non-KV) payloads; every rank moves its KV."""
        if self.tp.world_size > 1:
            return self.tp.rank_in_group == 0
        return self.local_rank == 0 if self.stage_config.tp_size > 1 else True

    # reference-compatible views for payload builders
    @property
    def put_req_chunk(self) -> PutChunkView:
        return PutChunkView(self._registry)

    @property
    def request_payload(self) -> RequestPayloadView:
        return RequestPayloadView(self._registry)

    @property
    def code_prompt_token_ids(self) -> CodePromptView:
        return CodePromptView(self._registry)

    # ------------------------------------------------------------------ sending
    def _build(self, request_id: str, request: Any, output: Any, is_finished: bool) -> tuple[bool, Any]:
        """Run the builder on the caller's thread: ``(ok, payload)``; a crash reports the request failed."""
        assert self.builder is not None
        try:
            return True, self.builder(transfer_manager=self, pooling_output=output, request=request, is_finished=is_finished)
        except Exception:
            logger.exception("payload builder %s failed for request %s; reporting it failed", self.builder.path, request_id)
            with self._lock:
                self._registry.outbox.failed.add(request_id)
            return False, None

    def _enqueue(self, state: RequestState, payload: Any) -> None:
        assert self._sender is not None
        if self.tuning.snapshot_payloads:
            payload = snapshot_payload(payload)
        with self._lock:
            index = state.next_send_chunk
            state.next_send_chunk += 1
            signal = self._sender.enqueue_locked(state, f"{state.external_id}_{self.stage_id}_{index}", payload, hand_over=True)
        self._sender.hand_over(signal)

    def send_chunk(self, request: Any, pooling_output: Any = None) -> bool:
        """Streaming mode: build this step's chunk on the caller's thread and enqueue it.

        Returns True when a chunk was enqueued (and on non-zero TP ranks, which
        never send ordinary payloads); False with no connector, no builder, or a
        builder that returned None (nothing to send this step) or raised.
        """
        if self._sender is None or self._closed:
            return False
        if not self.is_data_transfer_rank():
            return True
        if self.builder is None:
            logger.warning("stage %s: send_chunk without a payload builder (custom_process_next_stage_input_func)", self.stage_id)
            return False
        rid = _request_id(request)
        state = self._registry.lookup(rid)  # a known request needs no lock round (one dict read)
        if state is None:
            with self._lock:
                state = self._registry.ensure(rid, _external_id(request, rid))
        ok, payload = self._build(rid, request, pooling_output, _request_finished(request, False))
        if not ok or payload is None:
            return False
        self._enqueue(state, payload)
        return True

    def accumulate_full_payload_output(self, req_id: str, output: Any, request: Any = None) -> bool:
        """Full-payload mode, once per step: fold this step's output into the request's accumulator."""
        if not self._accumulate:
            return False
        replace = self.builder.replace_keys if self.builder is not None else frozenset()
        with self._lock:
            state = self._registry.ensure(req_id, _external_id(request, req_id))
            if state.full_payload is None:
                state.full_payload = FullPayloadAccumulator(replace)
            state.full_payload.add(output, request)
        return True

    def flush_full_payload_outputs(self, finished_req_ids: Iterable[str]) -> list[str]:
        """Materialise and send the accumulated outputs of finished requests; returns ids enqueued."""
        taken: dict[str, FullPayloadAccumulator] = {}
        with self._lock:
            for rid in finished_req_ids:
                state = self._registry.get(rid)
                if state is not None and state.full_payload is not None:
                    taken[state.request_id], state.full_payload = state.full_payload, None
        if not taken:
            return []
        outputs = {rid: (acc.materialize(), acc.request) for rid, acc in taken.items()}
        return self.send_full_payload_outputs(outputs)

    def send_full_payload_outputs(self, outputs: Mapping[str, Any]) -> list[str]:
        """Send whole payloads: each value is ``(output, request)`` or a raw output.

        With a builder the builder makes the payload (None skips the request).
        Only the data-transfer rank enqueues; other ranks report the ids as sent.
        """
        if self._sender is None or self._closed:
            return []
        if not self.is_data_transfer_rank():
            return list(outputs)
        sent: list[str] = []
        for rid, value in outputs.items():
            output, request = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            payload = output
            if self.builder is not None:
                ok, payload = self._build(rid, request, output, _request_finished(request, True))
                if not ok:
                    continue
            if payload is None:
                logger.debug("stage %s: nothing to send for %s", self.stage_id, rid)
                continue
            with self._lock:
                state = self._registry.ensure(rid, _external_id(request, rid))
            self._enqueue(state, payload)
            sent.append(rid)
        return sent

    def send_stage_outputs(self, scheduler_output: Any, outputs: Mapping[str, Any]) -> list[str]:
        """Reference-compatible spelling of :meth:`send_full_payload_outputs`."""
        return self.send_full_payload_outputs(outputs)

    # ------------------------------------------------------------------ receiving
    def register_chunk_recv(self, request: Any) -> bool:
        """Ask the receive thread to look for this request's input. Returns True when newly registered.

        Stage 0 never receives. A request whose payload already arrived, whose
        stream finished, or that is already registered is not registered again.
        """
        if self.stage_id == 0 or self._connector is None or self._closed:
            return False
        rid = _request_id(request)
        with self._lock:
            state = self._registry.ensure(rid, _external_id(request, rid))
            if state.released or state.registered or state.payload_arrived or state.stream_finished:
                return False
            self._registry.set_registered(state, True)
            now = time.monotonic()
            state.deadline = now + self.stage_config.recv_timeout_s
            state.last_arrival = now
        if self._receiver is not None:
            self._receiver.notify()
        return True

    def wait_ready(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until something arrived for the model thread (an idle runner's sleep)."""
        return self._delivery.ready.wait(timeout)

    def recv_chunk(self) -> dict[str, Any]:
        """Streaming mode: copies of the payloads of requests woken since the last :meth:`collect_signals`."""
        with self._lock:
            return self._delivery.ready_payloads()

    def recv_full_payload_inputs(self, scheduler_output: Any = None) -> dict[str, Any]:
        """Full-payload mode: publish what arrived and return ``{request_id: payload}``.

        With TP > 1 this is collective: rank 0 broadcasts, so no rank sees a
        request before its payload is visible. A cheap no-op on one rank when
        nothing arrived.
        """
        multi = self.tp.world_size > 1
        if not multi and self._delivery.unpublished == 0:
            return {}
        leader = self.is_data_transfer_rank()
        packet: dict[str, Any] | None = None
        if leader:
            with self._lock:
                packet = self._delivery.take_full_payload_packet()
        if multi:
            packet = self.tp.broadcast_object(packet, src=0)
        if not packet:
            return {}
        with self._lock:
            results = self._delivery.publish_full_payloads(packet, leader=leader)
        if results:
            logger.debug("stage %s: published full payloads of %s", self.stage_id, sorted(results))
        return results

    recv_stage_inputs = recv_full_payload_inputs

    def get_local_stage_payload(self, req_id: str) -> Any:
        """The runner's cached payload of a request (not removed)."""
        with self._lock:
            state = self._registry.get(req_id)
            return state.settle_cached() if state is not None else None

    def pop_local_stage_payload(self, req_id: str) -> Any:
        """Consume the cached payload. Generation workers must do this before their next chunk is fetched."""
        with self._lock:
            state = self._registry.get(req_id)
            payload = state.pop_cached() if state is not None else None
        if payload is not None and self._receiver is not None:
            self._receiver.notify()
        return payload

    # ------------------------------------------------------------------ signals
    def collect_signals(self) -> ConnectorSignals:
        """Drain this step's report (the reference's ``get_omni_connector_output``).

        With TP > 1 in streaming mode this is collective: rank 0 packs signals and
        staged payloads into one packet, the other ranks apply it.
        """
        packet: dict[str, Any] | None = None
        if self.async_chunk and self.tp.world_size > 1:
            leader = self.is_data_transfer_rank()
            if leader:
                with self._lock:
                    packet = self._delivery.take_stream_packet(with_payloads=True)
            packet = self.tp.broadcast_object(packet, src=0)
            assert packet is not None
            if not leader:
                with self._lock:
                    self._delivery.apply_stream_packet(packet)
        with self._lock:  # one hold on a single rank: take the flags and build the report together
            if packet is None:  # single rank: one pass over the signalled states
                woken, finished, metadata, stage_recv, pending = self._delivery.drain_signals()
            else:
                woken, finished, metadata = set(packet["woken"]), set(packet["finished"]), dict(packet["metadata"])
                stage_recv = set()
                for state in self._registry.signalled():
                    if state.stage_recv:
                        stage_recv.add(state.request_id)
                        state.stage_recv = False
                pending = self._registry.settle()
            outbox = self._registry.outbox
            # hand the outbox's containers over and give it fresh ones (no copy and clear per call)
            kv_sent, failed, timed_out = outbox.kv_sent, outbox.failed, outbox.timed_out
            if kv_sent:
                outbox.kv_sent = []
            if failed:
                outbox.failed = set()
            if timed_out:
                outbox.timed_out = set()
            signals = ConnectorSignals(
                chunk_ready=woken,
                chunk_finished=finished,
                request_metadata=metadata,
                kv_sent=kv_sent if kv_sent else [],
                stage_recv=stage_recv,
                has_pending_kv_work=self._kv.has_pending_work(),
                failed=failed if failed else set(),
                timed_out=timed_out if timed_out else set(),
            )
            ready = self._delivery.ready
            if not pending and not outbox.dropped_for_followers and ready.is_set():  # set only under this lock: no race
                ready.clear()
        if self._receiver is not None and self.worker_type == "generation" and (woken or metadata):
            self._receiver.notify()  # a request whose flags were drained may take its next chunk now
        return signals

    get_omni_connector_output = collect_signals

    # ------------------------------------------------------------------ lifecycle
    def cleanup_finished_request(self, req_id: str, *, aborted: bool = False) -> bool:
        """Drop everything of a request (internal or external id). Returns True if it was known.

        Any accumulated full payload is flushed first (a failure is logged, not
        raised). Send-side state waits for in-flight sends; chunks sent to this
        stage for the request but never read are freed from the connector.
        ``aborted`` (the request will not complete) skips the flush, drops
        queued sends and frees every key this stage put for the request (once
        a running put completed) and the KV shards this rank sent.
        """
        with self._lock:
            state = self._registry.get(req_id)
            accumulating = state is not None and state.full_payload is not None and not aborted
        if accumulating and state is not None:
            try:
                self.flush_full_payload_outputs([state.request_id])
            except Exception:
                logger.warning("flushing the full payload of %s during cleanup failed; continuing", req_id, exc_info=True)
        with self._lock:
            state = self._registry.get(req_id)
            ids = {req_id} if state is None else {req_id, state.request_id, state.external_id}
            self._registry.outbox.forget(ids)
            keys: list[str] = []
            purge: list[str] = []
            if state is not None:
                if self._receiver is not None:
                    keys = self._delivery.abort_keys(state)
                if aborted and self._sender is not None and state.next_send_chunk:
                    if self._sender.abort(state):
                        state.purge_sent = True  # the running put's completion frees them
                    else:
                        purge = self._sender.keys_put(state)
                self._registry.release(state)
        self._free_keys(keys)
        if purge and self._sender is not None and self._connector is not None and not self._connector.closed:
            self._sender.purge(purge)
        self._kv.cleanup(req_id, aborted=aborted)
        return state is not None

    def _free_keys(self, keys: list[str]) -> None:
        connector = self._connector
        if connector is None or connector.closed:
            return
        self._cleanup_backlog.free_in_order(connector, keys)

    def prune_inactive_requests(self, active_req_ids: Iterable[str] | None) -> set[str]:
        """Drop requests not in ``active_req_ids``, except those waiting for input or
        holding input the scheduler has not been told about (they may not be in the
        caller's set yet; orphaned waits end by timeout). Returns the ids dropped."""
        if active_req_ids is None:
            return set()
        active = set(active_req_ids)
        with self._lock:
            stale = [
                s.request_id
                for s in self._registry
                if not s.released and s.request_id not in active and s.external_id not in active and not s.has_undelivered_input()
            ]
        for rid in stale:
            self.cleanup_finished_request(rid)
        return set(stale)

    def shutdown(self) -> None:
        """Let queued sends finish (bounded), stop both threads (bounded joins), close the connector. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sender is not None:
            self._sender.wait_idle(self.tuning.drain_timeout_s)
            self._sender.stop(self.tuning.join_timeout_s)
        if self._receiver is not None:
            self._receiver.stop(self.tuning.join_timeout_s)
        if self._connector is not None and len(self._cleanup_backlog) and not self._connector.closed:
            freed = self._cleanup_backlog.retry(self._connector, self.tuning.drain_timeout_s)
            logger.info("stage %s: freed %d key(s) whose cleanup had failed", self.stage_id, freed)
        if self._owns_kv and self._kv.manager is not None:
            try:
                self._kv.manager.close()
            except Exception:
                logger.warning("closing the KV manager failed", exc_info=True)
        if self._connector is not None and self._close_connector:
            try:
                self._connector.close()
            except Exception:
                logger.warning("closing the connector failed", exc_info=True)

    shutdown_omni_connectors = shutdown

    def __enter__(self) -> StageTransferRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_sends(self, timeout: float = 5.0) -> bool:
        """Block until every enqueued send completed or was dropped (tests, orderly hand-over)."""
        return self._sender.wait_idle(timeout) if self._sender is not None else True

    # ------------------------------------------------------------------ introspection
    def active_request_count(self) -> int:
        """Requests the runtime holds any state for (0 after every request was cleaned up)."""
        with self._lock:
            return len(self._registry)

    def debug_state(self) -> dict[str, Any]:
        """A JSON-able dump: per-request summaries, indexes, thread stats."""
        with self._lock:
            snap = self._registry.snapshot()
        snap["sender"] = dict(self._sender.stats, cpu_s=self._sender.cpu_seconds()) if self._sender else None
        snap["receiver"] = dict(self._receiver.stats, cpu_s=self._receiver.cpu_seconds()) if self._receiver else None
        snap["arrival_mode"] = self.arrival_mode
        snap["arrival_waits_any"] = self._receiver.waits_any if self._receiver else None
        snap["arrival_wait_interruptible"] = self._receiver.interrupts if self._receiver else None
        return snap

    # ------------------------------------------------------------------ KV
    def send_kv_cache(
        self,
        finished_reqs: Mapping[str, Mapping[str, Any]],
        kv_caches: Any,
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        """Send the KV of finished requests via the KV manager (ids recorded for ``kv_sent``)."""
        return self._kv.send(finished_reqs, kv_caches, block_size, cache_dtype, request_id_resolver)

    def recv_kv_cache(self, request_id: str, target_device: Any = None) -> tuple[dict[str, Any] | None, int]:
        return self._kv.recv(request_id, target_device)

    def receive_cfg_companion_kv_payloads(
        self, cfg_request_ids: Mapping[str, str], target_device: Any = None
    ) -> dict[str, tuple[dict[str, Any] | None, int]]:
        """``{role: request_id}`` -> ``{role: (payload | None, size)}``."""
        return self._kv.recv_companions(cfg_request_ids, target_device)

    def receive_multi_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[[str, dict[str, Any]], Mapping[str, Any] | None] | None = None,
        target_device: Any = None,
        active_request_ids: Iterable[str] | None = None,
    ) -> bool:
        """Primary KV (applied to ``req``) plus CFG companions (via ``cfg_kv_collect_func``)."""
        return self._kv.recv_multi(req, cfg_kv_collect_func, target_device, active_request_ids)

    def mark_kv_transfer(self, req_id: str, seq_len: int, block_ids: list[int], custom_metadata: dict[str, Any] | None = None) -> bool:
        """Mark a request's KV for transfer (pending). A request already pending or active is not marked again."""
        with self._lock:
            return self._kv.mark(req_id, seq_len, block_ids, custom_metadata)

    def drain_pending_kv_transfers(self) -> dict[str, dict[str, Any]]:
        """Pending -> active; returns ``{req_id: {seq_len, block_ids, custom_metadata?}}`` to send."""
        with self._lock:
            return self._kv.drain_pending()

    def ack_kv_transfers(self, req_ids: Iterable[str]) -> None:
        """Active -> completed."""
        with self._lock:
            self._kv.ack(req_ids)

    def drain_completed_kv_transfers(self) -> set[str]:
        """Completed ids (their blocks can be freed); they leave the lifecycle."""
        with self._lock:
            return self._kv.drain_completed()

    def is_kv_transfer_triggered(self, req_id: str) -> bool:
        with self._lock:
            return self._kv.triggered(req_id)

    def has_pending_kv_work(self) -> bool:
        with self._lock:
            return self._kv.has_pending_work()

    # rank helpers (delegate to omni_plugins.kv.ranks)
    def get_kv_remote_ranks(self) -> list[int]:
        return self._kv.remote_ranks()

    def get_kv_target_ranks_for_send(self) -> list[int]:
        return self._kv.target_ranks()

    def get_kv_connector_key(self, req_id: str, from_stage: int, chunk_id: int, from_rank: int, to_rank: int) -> str:
        from omni_plugins.kv.ranks import kv_key

        return kv_key(req_id, from_stage, chunk_id, from_rank, to_rank)

    def get_rank_aware_kv_keys(self, req_id: str, from_stage: int, to_stage: int | None = None, chunk_id: int = 0) -> list[str]:
        return self._kv.recv_keys(req_id, from_stage, chunk_id)

    def get_rank_aware_kv_send_keys(self, req_id: str, from_stage: int, to_stage: int | None = None, chunk_id: int = 0) -> list[str]:
        return self._kv.send_keys(req_id, from_stage, chunk_id)

    def merge_rank_sharded_kv_payloads(self, payloads: list[dict[str, Any]]) -> dict[str, Any] | None:
        return self._kv.merge(payloads)

    def slice_rank_sharded_kv_payload(self, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        return self._kv.slice(payload)

    def get_kv_rank_mapping(self) -> dict[str, Any]:
        return {
            "from_tp": self.rank_mapping.from_tp,
            "to_tp": self.rank_mapping.to_tp,
            "local_rank": self.local_rank,
            "is_data_transfer_rank": self.is_data_transfer_rank(),
        }
