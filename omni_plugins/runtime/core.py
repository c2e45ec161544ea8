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
from omni_plugins.config.topology import StageTopology
from omni_plugins.contract import Connector
from omni_plugins.errors import ConfigError, OmniPluginsError
from omni_plugins.factory import create_connector, format_validation_error
from omni_plugins.metrics import NO_OBSERVER, EdgeObserver
from omni_plugins.payload import ResolvedBuilder, resolve_stage_builder
from omni_plugins.runtime import observe
from omni_plugins.runtime.accumulate import FullPayloadAccumulator
from omni_plugins.runtime.backlog import CleanupBacklog
from omni_plugins.runtime.builderview import BuilderManager
from omni_plugins.runtime.compat import CodePromptView, PutChunkView, RequestPayloadView
from omni_plugins.runtime.delivery import Delivery
from omni_plugins.runtime.kvbridge import KVBridge
from omni_plugins.runtime.receiver import Receiver
from omni_plugins.runtime.routes import InputRoute, OutputRoute
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


def _configured_callable(path: str | None, what: str) -> Callable[..., Any] | None:
    """The function a stage config names by dotted path (None when it names none); a ConfigError when it is not one."""
    if not path:
        return None
    from omni_plugins.importing import import_string

    try:
        func = import_string(path)
    except Exception as exc:
        raise ConfigError(f"{what}: {path!r} cannot be imported: {type(exc).__name__}: {exc}") from exc
    if not callable(func):
        raise ConfigError(f"{what}: {path!r} is not callable")
    return func  # type: ignore[no-any-return]


def _send_groups(routes: list[OutputRoute]) -> list[tuple[ResolvedBuilder | None, list[OutputRoute]]]:
    """Output routes by the builder that makes their payload (a builder naming ``to_stage``: one group per route)."""
    groups: dict[Any, tuple[ResolvedBuilder | None, list[OutputRoute]]] = {}
    for route in routes:
        builder = route.builder
        key: Any = route if builder is not None and builder.per_destination else (builder.path if builder is not None else None)
        groups.setdefault(key, (builder, []))[1].append(route)
    return list(groups.values())


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
        metrics: a :class:`~omni_plugins.metrics.StageMetrics` the runtime reports every
            edge's puts, gets, failures and in-flight requests to, and every connector's
            health (see :mod:`omni_plugins.runtime.observe`); None: no metrics.
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
        topology: StageTopology | None = None,
        connectors: Mapping[str, Connector] | None = None,
        metrics: Any | None = None,
    ) -> None:
        self.stage_config = stage_config
        self.stage_id = stage_config.stage_id
        self.tuning = tuning or RuntimeTuning()
        if topology is not None and (connector_config is not None or connector is not None):
            raise ConfigError(f"stage {self.stage_id}: give a topology (and its connectors) or one connector, not both")
        if topology is not None and topology.stage_id != self.stage_id:
            raise ConfigError(f"stage {self.stage_id}: the topology given is stage {topology.stage_id}'s")
        self.topology = topology
        self.connector_config = self._validate_connector_config(connector_config)
        cfg = self.connector_config
        self._close_connector = close_connector
        #: every connector this runtime uses, by instance name (one runtime owns one per distinct instance)
        self._connectors: dict[str, Connector] = {}
        #: connectors this runtime created (always closed at shutdown) vs. given (closed unless close_connector=False)
        self._created: set[str] = set()
        if topology is not None:
            self._open_connectors(topology, connectors or {})
        elif connector is not None or cfg is not None:
            self._connectors[cfg.name if connector is None and cfg is not None else getattr(connector, "name", "connector")] = (
                connector if connector is not None else self._create_connector(cfg)  # type: ignore[arg-type]
            )
            if connector is None:
                self._created = set(self._connectors)
        self._connector: Connector | None = next(iter(self._connectors.values()), None)
        connector = self._connector
        #: builder settings by connector instance (what the payload builders read as their connector's config)
        self._builder_settings: dict[str, Mapping[str, Any]] = (
            {name: conf.builder_settings for name, conf in topology.connectors.items()}
            if topology is not None
            else {name: cfg.builder_settings for name in self._connectors}
            if cfg is not None
            else {}
        )
        self.async_chunk = stage_config.async_chunk
        self.worker_type = stage_config.worker_type
        inputs = stage_config.input_stages()
        if topology is not None:
            self.next_stage_id = topology.outputs[0].to_stage if topology.outputs else self.stage_id + 1
            self.from_stage = topology.inputs[0].from_stage if len(topology.inputs) == 1 else self.stage_id - 1
        else:
            self.next_stage_id = cfg.to_stage if cfg is not None and cfg.to_stage is not None else self.stage_id + 1
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
        self._outputs, self._inputs = self._routes()
        #: output routes grouped by the builder that makes their payload: one build per group and step
        self._send_groups = _send_groups(self._outputs)
        self._has_builder = any(builder is not None for builder, _ in self._send_groups)
        #: what each send group's builder gets as ``transfer_manager``: the runtime, or a view of it whose
        #: ``connector.config`` holds the builder settings of the group's connector (vLLM-Omni's builders read them)
        self._builder_managers = [self._builder_manager(routes[0]) for _, routes in self._send_groups]
        # the accumulation gate is structural: decide once
        self._accumulate = bool(
            stage_config.custom_process_next_stage_input_func
            and not self.async_chunk
            and not stage_config.final_output
            and stage_config.model_stage is not None
            and connector is not None
            and self._outputs
        )

        self._registry = RequestRegistry(self._inputs, outputs=len(self._outputs))
        self._lock = self._registry.lock
        self._metrics = metrics
        if metrics is not None:
            observe.bind(metrics, self._registry, self._outputs, self._inputs, self._connectors)
        multi = self.tp.world_size > 1
        self._delivery = Delivery(
            self._registry,
            async_chunk=self.async_chunk,
            worker_type=self.worker_type,
            recv_timeout_s=stage_config.recv_timeout_s,
            abort_scan_limit=self.tuning.abort_scan_limit,
            multi_rank=multi,
            fan_in=len(self._inputs) > 1,
        )
        #: the stage's cfg_kv_collect_func (CFG companion KV -> sampling-param fields), used when a caller gives none
        self._cfg_kv_collect = _configured_callable(stage_config.cfg_kv_collect_func, f"stage {self.stage_id}: cfg_kv_collect_func")
        self._owned_kv: list[Any] = []
        send_managers: list[Any] | None = None
        if kv_manager is None and stage_config.kv_transfer and connector is not None:
            kv_manager, send_managers = self._kv_managers()
            self._owned_kv = [m for m in [kv_manager, *(send_managers or [])] if m is not None]
        self._kv = KVBridge(
            self._registry,
            kv_manager,
            from_tp=self.rank_mapping.from_tp,
            to_tp=self.rank_mapping.to_tp,
            local_rank=self.local_rank,
            send_managers=send_managers,
        )

        self._sender: Sender | None = None
        self._receivers: list[Receiver] = []
        #: key scans a backend error cut short (timeouts, aborts), retried at shutdown
        self._cleanup_backlog = CleanupBacklog()
        self._closed = False
        tag = f"stage{self.stage_id}-r{self.local_rank}"
        if self._outputs:
            self._sender = Sender(
                self._outputs,
                self._registry,
                max_retries=self.tuning.max_send_retries,
                retry_backoff_s=self.tuning.retry_backoff_s,
                handoff_s=self.tuning.send_handoff_s,
                name=f"omni-send-{tag}",
                cleanup_backlog=self._cleanup_backlog,
            )
        if self._inputs and self.is_data_transfer_rank():
            by_connector: dict[int, list[InputRoute]] = {}
            for route in self._inputs:
                by_connector.setdefault(id(route.connector), []).append(route)
            for n, routes in enumerate(by_connector.values()):
                self._receivers.append(
                    Receiver(
                        routes[0].connector,
                        self._registry,
                        self._delivery,
                        routes=[r.index for r in routes],
                        tuning=self.tuning,
                        name=f"omni-recv-{tag}" + (f"-{n}" if n else ""),
                        cleanup_backlog=self._cleanup_backlog,
                    )
                )
        logger.info(
            "stage %s runtime: connectors=%s async_chunk=%s worker=%s inputs=%s outputs=%s builder=%s arrival=%s",
            self.stage_id,
            {name: c.name for name, c in self._connectors.items()},
            self.async_chunk,
            self.worker_type,
            [r.from_stage for r in self._inputs],
            [r.to_stage for r in self._outputs],
            self.builder.path if self.builder else None,
            self.arrival_mode,
        )

    def _open_connectors(self, topology: StageTopology, given: Mapping[str, Connector]) -> None:
        """One connector per distinct instance the topology uses (given ones are taken as they are); all or none."""
        try:
            for name, conf in topology.connectors.items():
                if name in given:
                    self._connectors[name] = given[name]
                    continue
                try:
                    self._connectors[name] = create_connector(conf.name, conf.extra)
                except OmniPluginsError as exc:
                    raise ConfigError(f"stage {self.stage_id}: cannot create connector {name!r} ({conf.name}): {exc}") from exc
                self._created.add(name)
        except BaseException:
            for name in self._created:
                self._connectors[name].close()
            raise

    def _routes(self) -> tuple[list[OutputRoute], list[InputRoute]]:
        """The output and input routes: from the topology, else the single edge of the connector config."""
        topo = self.topology
        if topo is None:
            if self._connector is None:
                return [], []
            instance = next(iter(self._connectors))
            outputs = [OutputRoute(0, self.stage_id, self.next_stage_id, str(self.stage_id), self._connector, instance, self.builder)]
            inputs = [] if self.stage_id == 0 else [InputRoute(0, self.from_stage, self.stage_id, str(self.from_stage), self._connector, instance)]
            return outputs, inputs
        outputs = []
        for i, e in enumerate(topo.outputs):
            builder = self.builder
            if e.payload_builder is not None:
                from omni_plugins.payload import load_builder

                builder = load_builder(e.payload_builder)
            outputs.append(OutputRoute(i, self.stage_id, e.to_stage, e.key_stage, self._connectors[e.connector], e.connector, builder))
        inputs = [
            InputRoute(i, e.from_stage, self.stage_id, e.key_stage, self._connectors[e.connector], e.connector) for i, e in enumerate(topo.inputs)
        ]
        return outputs, inputs

    def _kv_managers(self) -> tuple[Any | None, list[Any] | None]:
        """The KV managers this stage needs: ``(receiving, sending)``; ``sending`` None means the receiving one sends too."""
        from omni_plugins.kv import KVTransferManager

        common: dict[str, Any] = {
            "stage_id": self.stage_id,
            "rank_mapping": self.rank_mapping,
            "local_rank": self.local_rank,
            "recv_timeout_s": self.stage_config.recv_timeout_s,
            "layout": self.stage_config.kv_layout,
        }
        topo = self.topology
        if topo is None:  # one connector: one manager both ways
            return KVTransferManager(self._connector, from_stage=self.from_stage, to_stage=self.next_stage_id, **common), None
        receiving = None
        if (edge := topo.kv_input) is not None:
            receiving = KVTransferManager(
                self._connectors[edge.kv_connector], from_stage=edge.from_stage, to_stage=self.stage_id, recv_key_stage=edge.key_stage, **common
            )
        # one sending manager per connector instance: KV edges that share one get each request's KV extracted
        # once and put under all their keys with one put_many
        by_connector: dict[str, list[tuple[int, str]]] = {}
        for e in topo.kv_outputs:
            by_connector.setdefault(e.kv_connector, []).append((e.to_stage, e.key_stage))
        sending = [
            KVTransferManager(
                self._connectors[name],
                from_stage=self.from_stage,
                to_stage=destinations[0][0],
                send_key_stage=destinations[0][1],
                receives=False,
                destinations=destinations,
                **common,
            )
            for name, destinations in by_connector.items()
        ]
        if receiving is None and not sending:
            logger.warning("stage %s has kv_transfer but no KV edge (no neighbour with kv_transfer): no KV moves", self.stage_id)
        return receiving, sending

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pipeline(cls, pipeline_config: PipelineConfig, stage_id: int, **kwargs: Any) -> StageTransferRuntime:
        """The runtime of ``stage_id`` in a validated pipeline: every edge of the stage, each on its own connector instance.

        A stage with no edge at all keeps the single-connector form (``default_connector``,
        see :meth:`PipelineConfig.stage_connector_config`).
        """
        stage = pipeline_config.stage(stage_id)
        topology = pipeline_config.topology(stage_id)
        if not topology.inputs and not topology.outputs:
            return cls(stage, pipeline_config.stage_connector_config(stage_id), **kwargs)
        return cls(stage, topology=topology, **kwargs)

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
        """The runtime's connector; with several (a topology), the first one (see :attr:`connectors`)."""
        return self._connector

    @property
    def connectors(self) -> dict[str, Connector]:
        """Every connector this runtime owns or was given, by instance name."""
        return dict(self._connectors)

    @property
    def kv_manager(self) -> Any | None:
        """The KV manager that receives (else the first that sends)."""
        return self._kv.manager if self._kv.manager is not None else next(iter(self._kv.send_managers), None)

    @property
    def kv_managers(self) -> list[Any]:
        """Every KV manager of this runtime (the receiving one first)."""
        return self._kv.managers

    @property
    def arrival_mode(self) -> str | None:
        """``"block"`` or ``"poll"`` on the rank that receives (its first receive thread); None elsewhere."""
        return self._receivers[0].mode if self._receivers else None

    @property
    def input_stages(self) -> list[int]:
        """The stages this one receives from (several: a fan-in stage, whose payloads are ``{source_stage: payload}``)."""
        return [r.from_stage for r in self._inputs]

    @property
    def output_stages(self) -> list[int]:
        """The stages this one sends to (every send goes to each)."""
        return [r.to_stage for r in self._outputs]

    @property
    def fan_in(self) -> bool:
        return len(self._inputs) > 1

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
    def _builder_manager(self, route: OutputRoute) -> Any:
        settings = self._builder_settings.get(route.instance or "")
        return BuilderManager(self, route.connector, settings) if settings else self

    def _build(
        self, builder: ResolvedBuilder, request_id: str, request: Any, output: Any, is_finished: bool, to_stage: int | None, manager: Any
    ) -> tuple[bool, Any]:
        """Run a builder on the caller's thread: ``(ok, payload)``; a crash reports the request failed."""
        try:
            return True, builder(transfer_manager=manager, pooling_output=output, request=request, is_finished=is_finished, to_stage=to_stage)
        except Exception:
            logger.exception("payload builder %s failed for request %s; reporting it failed", builder.path, request_id)
            with self._lock:
                self._registry.outbox.failed.add(request_id)
            return False, None

    def _enqueue(self, state: RequestState, payload: Any, routes: list[OutputRoute]) -> None:
        """Queue one payload for every route in ``routes`` (snapshotted once, one key per route)."""
        sender = self._sender
        assert sender is not None
        if self.tuning.snapshot_payloads:
            payload = snapshot_payload(payload)
        sent = state.sent
        with self._lock:
            route = routes[0]
            index = sent[route.index]
            sent[route.index] = index + 1
            if not index:
                route.observer.started()
            signal = sender.enqueue_locked(state, route, f"{state.external_id}_{route.key_stage}_{index}", payload, hand_over=True)
            for route in routes[1:]:  # fan-out: the same payload to the other destinations
                index = sent[route.index]
                sent[route.index] = index + 1
                if not index:
                    route.observer.started()
                sender.enqueue_locked(state, route, f"{state.external_id}_{route.key_stage}_{index}", payload)
        sender.hand_over(signal)

    def _send(self, rid: str, state: RequestState, request: Any, output: Any, is_finished: bool, *, raw: bool) -> int:
        """Build (once per builder; per destination for builders that name ``to_stage``) and enqueue on every
        output route. ``raw``: a route group without a builder sends ``output`` as it is. Returns payloads
        enqueued; -1 when a builder raised (the request is reported failed, nothing more is sent)."""
        enqueued = 0
        for (builder, routes), manager in zip(self._send_groups, self._builder_managers, strict=True):
            if builder is None:
                if not raw:
                    continue
                payload = output
            else:
                to_stage = routes[0].to_stage if builder.per_destination else None
                ok, payload = self._build(builder, rid, request, output, is_finished, to_stage, manager)
                if not ok:
                    return -1
            if payload is None:
                continue
            self._enqueue(state, payload, routes)
            enqueued += 1
        return enqueued

    def send_chunk(self, request: Any, pooling_output: Any = None) -> bool:
        """Streaming mode: build this step's chunk on the caller's thread and enqueue it (on every output edge).

        Returns True when a chunk was enqueued (and on non-zero TP ranks, which
        never send ordinary payloads); False with no connector, no builder, or a
        builder that returned None (nothing to send this step) or raised.
        """
        if self._sender is None or self._closed:
            return False
        if not self.is_data_transfer_rank():
            return True
        if not self._has_builder:
            logger.warning("stage %s: send_chunk without a payload builder (custom_process_next_stage_input_func)", self.stage_id)
            return False
        rid = _request_id(request)
        state = self._registry.lookup(rid)  # a known request needs no lock round (one dict read)
        if state is None:
            with self._lock:
                state = self._registry.ensure(rid, _external_id(request, rid))
        return self._send(rid, state, request, pooling_output, _request_finished(request, False), raw=False) > 0

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
        """Send whole payloads (to every output edge): each value is ``(output, request)`` or a raw output.

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
            with self._lock:
                state = self._registry.ensure(rid, _external_id(request, rid))
            got = self._send(rid, state, request, output, _request_finished(request, True), raw=True)
            if got > 0:
                sent.append(rid)
            elif got == 0:
                logger.debug("stage %s: nothing to send for %s", self.stage_id, rid)
        return sent

    def send_stage_outputs(self, scheduler_output: Any, outputs: Mapping[str, Any]) -> list[str]:
        """Reference-compatible spelling of :meth:`send_full_payload_outputs`."""
        return self.send_full_payload_outputs(outputs)

    # ------------------------------------------------------------------ receiving
    def register_chunk_recv(self, request: Any) -> bool:
        """Ask the receive thread to look for this request's input (on every input edge). Returns True when newly registered.

        A stage with no input edge (stage 0) never receives. A request whose payload already
        arrived, whose stream finished, or that is already registered is not registered again.
        """
        if not self._inputs or self._closed:
            return False
        rid = _request_id(request)
        with self._lock:
            state = self._registry.ensure(rid, _external_id(request, rid))
            if state.released or state.registered or state.payload_arrived or state.stream_finished:
                return False
            now = time.monotonic()
            deadline = now + self.stage_config.recv_timeout_s
            for entry in state.inputs:
                if not entry.delivered:
                    self._registry.set_registered(entry, True)
                    entry.deadline = deadline
                    entry.last_arrival = now
        for receiver in self._receivers:
            receiver.notify()
        return True

    def wait_ready(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until something arrived for the model thread (an idle runner's sleep)."""
        return self._delivery.ready.wait(timeout)

    def recv_chunk(self) -> dict[str, Any]:
        """Streaming mode: copies of the payloads of requests woken since the last :meth:`collect_signals`.

        On a fan-in stage each value is ``{source_stage: payload}`` of the sources that woke it.
        """
        with self._lock:
            return self._delivery.ready_payloads()

    def recv_full_payload_inputs(self, scheduler_output: Any = None) -> dict[str, Any]:
        """Full-payload mode: publish what arrived and return ``{request_id: payload}``.

        On a fan-in stage a request is published once every input edge delivered,
        as ``{request_id: {source_stage: payload}}``. With TP > 1 this is
        collective: rank 0 broadcasts, so no rank sees a request before its
        payload is visible. A cheap no-op on one rank when nothing arrived.
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
        """The runner's cached payload of a request (not removed); ``{source_stage: payload}`` on a fan-in stage."""
        with self._lock:
            state = self._registry.get(req_id)
            return self._delivery.payload_of(state) if state is not None else None

    def pop_local_stage_payload(self, req_id: str) -> Any:
        """Consume the cached payload. Generation workers must do this before their next chunk is fetched."""
        with self._lock:
            state = self._registry.get(req_id)
            payload = self._delivery.pop_payload(state) if state is not None else None
        if payload is not None:
            for receiver in self._receivers:
                receiver.notify()
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
                woken, finished, metadata, stage_recv, pending, ready_src, finished_src = self._delivery.drain_signals()
            else:
                woken, finished, metadata = set(packet["woken"]), set(packet["finished"]), dict(packet["metadata"])
                sources = packet.get("sources", {})
                ready_src = {rid: set(pair[0]) for rid, pair in sources.items() if pair[0]}
                finished_src = {rid: set(pair[1]) for rid, pair in sources.items() if pair[1]}
                stage_recv = set()
                for state in self._registry.signalled():
                    if state.stage_recv:
                        stage_recv.add(state.request_id)
                        state.stage_recv = False
                pending = self._registry.settle()
            outbox = self._registry.outbox
            # hand the outbox's containers over and give it fresh ones (no copy and clear per call)
            kv_sent, failed, timed_out, missing = outbox.kv_sent, outbox.failed, outbox.timed_out, outbox.missing
            if kv_sent:
                outbox.kv_sent = []
            if failed:
                outbox.failed = set()
            if timed_out:
                outbox.timed_out = set()
            if missing:
                outbox.missing = {}
            signals = ConnectorSignals(
                chunk_ready=woken,
                chunk_finished=finished,
                request_metadata=metadata,
                kv_sent=kv_sent if kv_sent else [],
                stage_recv=stage_recv,
                has_pending_kv_work=self._kv.has_pending_work(),
                failed=failed if failed else set(),
                timed_out=timed_out if timed_out else set(),
                chunk_ready_sources=ready_src,
                chunk_finished_sources=finished_src,
                missing_sources=missing if missing else {},
            )
            ready = self._delivery.ready
            if not pending and not outbox.dropped_for_followers and ready.is_set():  # set only under this lock: no race
                ready.clear()
        if self.worker_type == "generation" and (woken or metadata):
            for receiver in self._receivers:
                receiver.notify()  # a request whose flags were drained may take its next chunk now
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
            keys: list[tuple[Connector, list[str]]] = []
            purge: list[tuple[Connector, str]] = []
            if state is not None:
                if self._receivers:
                    keys = self._delivery.abort_keys(state)
                if aborted and self._sender is not None and any(state.sent):
                    if self._sender.abort(state):
                        state.purge_sent = True  # the running put's completion frees them
                    else:
                        purge = self._sender.keys_put(state)
                self._registry.release(state)
        self._free_keys(keys)
        if purge and self._sender is not None:
            self._sender.purge(purge)
        self._kv.cleanup(req_id, aborted=aborted)
        return state is not None

    def _free_keys(self, keys: list[tuple[Connector, list[str]]]) -> None:
        for connector, scan in keys:
            if not connector.closed:
                self._cleanup_backlog.free_in_order(connector, scan)

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
        """Let queued sends finish (bounded), stop the threads (bounded joins), close every connector. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._sender is not None:
            self._sender.wait_idle(self.tuning.drain_timeout_s)
            self._sender.stop(self.tuning.join_timeout_s)
        for receiver in self._receivers:
            receiver.stop(self.tuning.join_timeout_s)
        if len(self._cleanup_backlog):
            freed = self._cleanup_backlog.retry(self.tuning.drain_timeout_s)
            logger.info("stage %s: freed %d key(s) whose cleanup had failed", self.stage_id, freed)
        if self._metrics is not None:
            observe.unbind(self._metrics, self._connectors)
        for manager in self._owned_kv:
            try:
                manager.close()
            except Exception:
                logger.warning("closing the KV manager failed", exc_info=True)
        for name, connector in self._connectors.items():
            if name in self._created or self._close_connector:
                try:
                    connector.close()
                except Exception:
                    logger.warning("closing the connector %r failed", name, exc_info=True)

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

    def edge_observer(self, from_stage: int, to_stage: int) -> EdgeObserver:
        """The metrics observer of the edge ``from_stage -> to_stage`` on this stage's side of it
        (:data:`~omni_plugins.metrics.NO_OBSERVER` without metrics or such an edge); a model that knows
        when a payload was sent reports the hand-off latency to it (``observer.handoff(seconds)``)."""
        routes: list[OutputRoute | InputRoute] = [*self._outputs, *self._inputs]
        for route in routes:
            if route.from_stage == from_stage and route.to_stage == to_stage:
                return route.observer
        return NO_OBSERVER

    def debug_state(self) -> dict[str, Any]:
        """A JSON-able dump: per-request summaries, indexes, thread stats (``receiver``: the first receive thread)."""
        with self._lock:
            snap = self._registry.snapshot()
        snap["sender"] = dict(self._sender.stats, cpu_s=self._sender.cpu_seconds()) if self._sender else None
        receivers = [dict(r.stats, cpu_s=r.cpu_seconds()) for r in self._receivers]
        snap["receiver"] = receivers[0] if receivers else None
        snap["receivers"] = receivers
        first = self._receivers[0] if self._receivers else None
        snap["arrival_mode"] = self.arrival_mode
        snap["arrival_waits_any"] = first.waits_any if first else None
        snap["arrival_wait_interruptible"] = first.interrupts if first else None
        #: whether the receive thread polls right before bursts it expects (``anticipate_s`` and ``poll_any``)
        snap["arrival_anticipates"] = first.rhythm is not None if first else None
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
        cfg_kv_collect_func: Callable[..., Mapping[str, Any] | None] | None = None,
        target_device: Any = None,
        active_request_ids: Iterable[str] | None = None,
    ) -> bool:
        """Primary KV (applied to ``req``) plus CFG companions (via ``cfg_kv_collect_func``, default: the stage's)."""
        collect = cfg_kv_collect_func if cfg_kv_collect_func is not None else self._cfg_kv_collect
        return self._kv.recv_multi(req, collect, target_device, active_request_ids)

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
