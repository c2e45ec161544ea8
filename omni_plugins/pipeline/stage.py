"""One stage rank of ``omni-plugins run``: a synthetic model driving a :class:`StageTransferRuntime`.

Runs in its own (spawned) process, one per stage replica and TP rank. Control
messages -- never payloads -- arrive on ``inbox`` (rank 0 only:
``("admit", request_id, route)`` where ``route`` says which replica of every
stage the request goes through, ``("abort", request_id)`` and ``("stop",)``)
and go to the orchestrator on ``results``. Payloads travel only through the
runtime's connectors, on every edge of the stage. With ``tp_size > 1`` the
ranks form a gloo process group; rank 0 broadcasts each step's plan
(admissions, stop) so the ranks call the runtime's collective methods in lockstep.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch

from omni_plugins.config.models import PipelineConfig
from omni_plugins.config.topology import Edge
from omni_plugins.errors import ConnectorError
from omni_plugins.pipeline.builders import BUILDER_PATH, ROUTED_BUILDER_PATH
from omni_plugins.pipeline.checksums import step_output
from omni_plugins.pipeline.inputs import InputCheck
from omni_plugins.pipeline.kvsynth import check_kv, paged_cache
from omni_plugins.pipeline.pipes import Inbox, Outbox
from omni_plugins.pipeline.spec import PipelinePlan, StagePlan, build_plan
from omni_plugins.pipeline.stats import EdgeStats
from omni_plugins.ports import LOOPBACK

logger = logging.getLogger(__name__)

#: how long one KV receive may wait per model step (KV is polled, not awaited)
KV_POLL_S = 0.005


@dataclass
class StageLaunch:
    """Everything a stage process needs (picklable: it crosses the spawn boundary)."""

    config: dict[str, Any]
    filename: str
    stage_id: int
    rank: int
    #: the port of the TP group's rendezvous store, served by the launcher (None: no TP group)
    dist_port: int | None = None
    log_level: int = logging.WARNING
    replica: int = 0
    #: serve Prometheus metrics under this ``stage`` label (on a free loopback port; None: no metrics)
    metrics_label: str | None = None


@dataclass
class SynthRequest:
    """The request object the runtime and the payload builder see."""

    request_id: str
    external_req_id: str
    finished: bool = False
    #: per destination stage, the output names it gets (``outputs[].to``; the routed builder reads it)
    routes: dict[int, frozenset[str]] = field(default_factory=dict)

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class _Req:
    """One request on this stage rank: input progress per source, output progress, KV."""

    request: SynthRequest
    #: which replica of each stage the request was routed to
    route: dict[int, int] = field(default_factory=dict)
    admitted: float = field(default_factory=time.monotonic)
    seen: dict[int, int] = field(default_factory=dict)  # upstream steps verified, per source stage
    finished_sources: set[int] = field(default_factory=set)  # sources whose stream ended / full payload arrived
    produced: int = 0
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)  # full-payload steps when the runtime does not accumulate
    kv_in: bool = False
    kv_sent: bool = False
    failed: str | None = None

    @property
    def rid(self) -> str:
        return self.request.request_id


def edge_label(edge: Edge, plan: PipelinePlan, sender_replica: int | None, receiver_replica: int | None) -> str:
    """``0->1``, with ``.rN`` after a replicated stage: which replicas the payloads went between."""
    left, right = str(edge.from_stage), str(edge.to_stage)
    if plan.plan(edge.from_stage).replicas > 1 and sender_replica is not None:
        left += f".r{sender_replica}"
    if plan.plan(edge.to_stage).replicas > 1 and receiver_replica is not None:
        right += f".r{receiver_replica}"
    return f"{left}->{right}"


class StageRunner:
    """The model loop of one stage rank."""

    def __init__(self, launch: StageLaunch, plan: PipelinePlan, inbox: Any, results: Any) -> None:
        from omni_plugins.runtime import StageTransferRuntime

        self.launch = launch
        self.plan = plan
        self.me: StagePlan = plan.plan(launch.stage_id)
        self.rank = launch.rank
        self.replica = launch.replica
        self.leader = launch.rank == 0
        self.inbox, self.results = inbox, results
        self.ups: dict[int, StagePlan] = {e.from_stage: plan.plan(e.from_stage) for e in self.me.inputs}
        self.tp = self._tp_group()
        stage = self.me.stage
        if self.me.outputs and self.me.synthetic.outputs:
            routed = any(o.to is not None for o in self.me.synthetic.outputs)
            stage = stage.model_copy(
                update={
                    "custom_process_next_stage_input_func": ROUTED_BUILDER_PATH if routed else BUILDER_PATH,
                    "model_stage": stage.model_stage or f"synthetic-{stage.stage_id}",
                }
            )
        if stage.kv_layout == "auto":
            stage = stage.model_copy(update={"kv_layout": "nhd"})  # the synthetic caches are built NHD
        kwargs: dict[str, Any] = {"tp_group": self.tp} if self.tp is not None else {}
        if self.tp is None and stage.tp_size > 1:
            kwargs["local_rank"] = self.rank
        self.metrics: Any = None
        if launch.metrics_label is not None:
            from omni_plugins.metrics import StageMetrics

            self.metrics = kwargs["metrics"] = StageMetrics(launch.metrics_label)
        topology = plan.config.topology(stage.stage_id)
        # per-edge builders name user code: the synthetic model's builder stands in for them too
        topology = replace(topology, outputs=tuple(replace(e, payload_builder=None) for e in topology.outputs))
        self.rt = StageTransferRuntime(stage, topology=topology, **kwargs)
        self.requests: dict[str, _Req] = {}
        self.aborted: set[str] = set()
        self.stop = False
        self.routes = {to: frozenset(o.name for o in self.me.outputs_to(to)) for to in self.me.downstreams}
        mode = "stream" if self.me.stage.async_chunk else "full"
        merged = self.me.stage.async_chunk and self.me.stage.worker_type == "ar"
        #: per input edge and sender replica: the check of what arrives, and its counters
        self.inputs: dict[tuple[int, int], InputCheck] = {}
        self.stats: list[EdgeStats] = []
        for e in self.me.inputs:
            up = self.ups[e.from_stage]
            for r in range(up.replicas):
                label = edge_label(e, plan, r, self.replica)
                stats = EdgeStats(f"{label} {e.connector} ({mode})")
                self.stats.append(stats)
                self.inputs[(e.from_stage, r)] = InputCheck(
                    up, to_stage=self.me.stage_id, merged=merged, stats=stats, observer=self.rt.edge_observer(e.from_stage, self.me.stage_id)
                )
        kv_edge = self.me.kv_input
        self.kv_up = self.ups[kv_edge.from_stage] if kv_edge is not None and self.ups[kv_edge.from_stage].synthetic.kv is not None else None
        self.kv_stats: dict[int, EdgeStats] = {}
        if kv_edge is not None and self.kv_up is not None:
            for r in range(self.kv_up.replicas):
                self.kv_stats[r] = EdgeStats(f"{edge_label(kv_edge, plan, r, self.replica)} {kv_edge.kv_connector} (KV)", kind="kv")
                self.stats.append(self.kv_stats[r])
        self.sends = bool(self.me.outputs) and bool(self.me.synthetic.outputs)

    def _tp_group(self) -> Any:
        if self.me.stage.tp_size == 1:
            return None
        import torch.distributed as dist

        from omni_plugins.runtime import TorchDistributedGroup

        os.environ["LOCAL_RANK"] = str(self.rank)
        assert self.launch.dist_port is not None
        # the launcher serves the group's store (bound before the ranks started): every rank joins it as a client
        store = dist.TCPStore(LOOPBACK, self.launch.dist_port, None, False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.me.stage.tp_size, timeout=timedelta(seconds=120))
        return TorchDistributedGroup()

    @property
    def where(self) -> str:
        replica = f" replica {self.replica}" if self.me.replicas > 1 else ""
        return f"stage {self.me.stage_id}{replica} rank {self.rank}"

    def post(self, kind: str, **data: Any) -> None:
        self.results.put({"kind": kind, "stage": self.me.stage_id, "replica": self.replica, "rank": self.rank, **data})

    # ------------------------------------------------------------------ control
    def _control(self, idle: bool) -> dict[str, Any]:
        plan: dict[str, Any] = {"admit": [], "abort": [], "stop": False}
        if self.leader:
            wait = 0.02 if idle and not self.requests else 0.0
            while True:
                try:
                    msg = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
                except queue.Empty:
                    break
                wait = 0.0
                if msg[0] == "admit":
                    plan["admit"].append([msg[1], msg[2]])
                elif msg[0] == "abort":
                    plan["abort"].append(msg[1])
                elif msg[0] == "stop":
                    plan["stop"] = True
        if self.tp is not None:
            plan = self.tp.broadcast_object(plan, src=0)
        return plan

    def _admit(self, rid: str, route: dict[Any, Any]) -> None:
        req = _Req(SynthRequest(rid, rid, routes=self.routes), route={int(k): int(v) for k, v in route.items()})
        req.seen = {src: 0 for src in self.ups}
        self.requests[rid] = req
        if rid in self.aborted:
            self.aborted.discard(rid)
            req.failed = f"{self.where}: aborted (failed elsewhere)"
            self._finish(req)
            return
        if self.ups:
            self.rt.register_chunk_recv(req.request)

    # ------------------------------------------------------------------ receive
    def _by_source(self, payload: Any) -> dict[int, Any]:
        """A received payload per source stage (a fan-in runtime already hands them so)."""
        if self.rt.fan_in:
            return dict(payload) if isinstance(payload, dict) else {}
        return {next(iter(self.ups)): payload}

    def _check(self, req: _Req, src: int, payload: Any) -> None:
        check = self.inputs[(src, req.route.get(src, 0))]
        req.seen[src] = check.check(req.rid, payload, req.seen[src])

    def _receive(self) -> bool:
        progress = False
        if not self.ups:
            signals = self.rt.collect_signals()
        elif self.me.stage.async_chunk:
            # recv_chunk() before collect_signals(): collecting drains the wake flags recv_chunk reads. On TP
            # followers recv_chunk() is always empty; they read what the leader broadcast in collect_signals().
            got = {rid: self._by_source(p) for rid, p in (self.rt.recv_chunk() if self.leader else {}).items()}
            signals = self.rt.collect_signals()
            finished = self._finished_sources(signals)
            woken = {rid: set(self.ups) for rid in signals.chunk_ready} if not self.rt.fan_in else signals.chunk_ready_sources
            # arrived between the two calls; a finished stream is read from the cache even when recv_chunk
            # returned it, since its last chunk may have landed in between (an "ar" accumulation only grows)
            for rid in set(woken) | set(finished):
                wanted = (woken.get(rid, set()) - set(got.get(rid, {}))) | finished.get(rid, set())
                if wanted:
                    cached = self._by_source(self.rt.get_local_stage_payload(rid))
                    got.setdefault(rid, {}).update({src: cached[src] for src in wanted if src in cached})
            for rid, by_src in got.items():
                req = self.requests.get(rid)
                if self.me.stage.worker_type == "generation":
                    self.rt.pop_local_stage_payload(rid)
                if req is None:
                    continue
                for src, payload in by_src.items():
                    if payload is not None:
                        self._check(req, src, payload)
                        progress = True
            for rid, sources in finished.items():
                req = self.requests.get(rid)
                if req is not None:
                    req.finished_sources |= sources
                    progress = True
        else:
            got = self.rt.recv_full_payload_inputs()
            signals = self.rt.collect_signals()
            for rid, payload in got.items():
                req = self.requests.get(rid)
                if req is None:
                    continue
                for src, part in self._by_source(payload).items():
                    self._check(req, src, part)
                req.finished_sources |= set(self.ups)
                progress = True
        for rid in signals.failed | signals.timed_out:
            req = self.requests.get(rid)
            if req is not None:
                if rid in signals.timed_out:
                    why = f"timed out waiting for input from stage(s) {signals.missing_sources.get(rid, sorted(self.ups))}"
                else:
                    why = "the runtime reported it failed"
                req.failed = req.failed or f"{self.where}: {why}"
                progress = True
        return progress

    def _finished_sources(self, signals: Any) -> dict[str, set[int]]:
        if self.rt.fan_in:
            return {rid: set(s) for rid, s in signals.chunk_finished_sources.items()}
        return {rid: set(self.ups) for rid in signals.chunk_finished}

    def _receive_kv(self, req: _Req) -> None:
        manager = self.rt.kv_manager
        assert self.kv_up is not None and manager is not None
        payload, size = manager.receive_kv_cache_for_request(req.rid, timeout_s=KV_POLL_S, keep_partial=True)
        if payload is None:
            return
        req.kv_in = True
        stats = self.kv_stats[req.route.get(self.kv_up.stage_id, 0)]
        if not check_kv(self.kv_up, req.rid, payload, size, to_tp=self.me.stage.tp_size, rank=self.rank, stats=stats):
            req.failed = f"{self.where}: KV mismatch"

    # ------------------------------------------------------------------ produce
    def _allowed_steps(self, req: _Req) -> int:
        steps = self.me.synthetic.steps
        allowed = steps
        for src, up in self.ups.items():
            if src not in req.finished_sources:
                allowed = min(allowed, req.seen[src] * steps // max(1, up.synthetic.steps))
        return allowed

    def _produce(self, req: _Req) -> bool:
        if not self.sends or req.produced >= min(self.me.synthetic.steps, self._allowed_steps(req)):
            return False
        syn = self.me.synthetic
        k = req.produced
        out: dict[str, torch.Tensor] = {o.name: step_output(syn.seed, req.rid, self.me.stage_id, o, k) for o in syn.outputs}
        out["trace.step"] = torch.tensor([[k]], dtype=torch.int64)
        last = k == syn.steps - 1
        req.produced += 1
        if syn.send == "stream":
            req.request.finished = last
            if not self.rt.send_chunk(req.request, out):
                req.failed = f"{self.where}: chunk {k} of {req.rid} was not enqueued"
        elif self.rt.should_accumulate_full_payload_output():
            self.rt.accumulate_full_payload_output(req.rid, out, req.request)
            if last:
                req.request.finished = True
                self.rt.flush_full_payload_outputs([req.rid])
        else:
            req.parts.append(out)
            if last:
                req.request.finished = True
                whole = {name: torch.cat([p[name] for p in req.parts], dim=0) for name in req.parts[0]}
                req.parts.clear()
                self.rt.send_full_payload_outputs({req.rid: (whole, req.request)})
        if last and syn.kv is not None:
            caches, info = paged_cache(self.me, req.rid, self.rt.local_rank)
            info["custom_metadata"] = {"sent_at": time.time()}
            self.rt.send_kv_cache({req.rid: info}, caches, syn.kv.block_size, syn.kv.dtype)
            req.kv_sent = True
        return True

    # ------------------------------------------------------------------ completion
    def _complete(self, req: _Req) -> bool:
        if req.failed:
            return True
        for src, up in self.ups.items():
            if src not in req.finished_sources:
                return False
            if req.seen[src] != up.synthetic.steps:
                req.failed = f"{self.where}: input from stage {src} ended after {req.seen[src]} of {up.synthetic.steps} steps"
                return True
        if self.kv_up is not None and not req.kv_in:
            self._receive_kv(req)
            if not req.kv_in:
                return False
        return not self.sends or req.produced >= self.me.synthetic.steps

    def _finish(self, req: _Req) -> None:
        del self.requests[req.rid]
        self.rt.cleanup_finished_request(req.rid, aborted=req.failed is not None)
        # every rank of every stage on the request's route reports: it is complete when all of them are done with it
        self.post("finished", rid=req.rid, reason=req.failed)

    # ------------------------------------------------------------------ loop
    def check_backend(self) -> None:
        """Fail at start, not at the run's timeout, when a connector cannot reach its backend.

        The test is each connector's ``health()``: ``ok`` false *with* an ``error`` (the check itself
        failed, e.g. a connection refused). ``ok`` false without one (a peer not started yet, a stale
        announcement) may heal once every stage runs, so it is only logged.
        """
        for instance, connector in self.rt.connectors.items():
            health = _health(connector)
            if health.get("ok", True):
                continue
            if health.get("error"):
                self.rt.shutdown()
                raise ConnectorError(f"connector {instance!r} ({connector.name}) cannot reach its backend: {health['error']}")
            logger.info("connector %r reports not ok at start (continuing): %s", instance, health)

    def run(self) -> None:
        self.check_backend()
        metrics_port = self.metrics.serve(0, "127.0.0.1") if self.metrics is not None else None
        self.post("ready", pid=os.getpid(), metrics_port=metrics_port)
        idle = True
        step_s = self.me.synthetic.step_ms / 1000.0
        while True:
            plan = self._control(idle)
            for rid, route in plan["admit"]:
                self._admit(rid, route)
            for rid in plan["abort"]:
                req = self.requests.get(rid)
                if req is None:
                    self.aborted.add(rid)  # not admitted here yet
                else:
                    req.failed = req.failed or f"{self.where}: aborted (failed elsewhere)"
                    self._finish(req)
            if plan["stop"]:
                break
            progress = self._receive()
            produced = False
            for req in list(self.requests.values()):
                if not req.failed:
                    produced = self._produce(req) or produced
                if self._complete(req):
                    self._finish(req)
                    progress = True
            if produced and step_s:
                time.sleep(step_s)
            idle = not (progress or produced or plan["admit"])
            if idle and self.requests and self.ups and self.tp is None:
                self.rt.wait_ready(0.005)
        self._close()

    def _close(self) -> None:
        drained = self.rt.wait_sends(10.0)
        # requests still in progress when the run stops (it was aborted) are aborted first: what counts
        # as a leak is what the runtime and the connector still hold after that, not the work cut short
        for rid in list(self.requests):
            self.rt.cleanup_finished_request(rid, aborted=True)
        self.rt.wait_sends(5.0)  # an aborted request's keys are freed once its running put completed
        leftover = self.rt.active_request_count()
        leftover_ids = sorted(self.rt.debug_state().get("requests", {}))[:10]
        kv_tracked = sorted({rid for m in self.rt.kv_managers for rid in m.tracked_request_ids()})
        health = {instance: _health(c) for instance, c in self.rt.connectors.items()}
        exposition = None
        if self.metrics is not None:  # the final counts and health (the host's endpoint serves them after this process ended)
            exposition = self.metrics.exposition().decode()
            self.metrics.close()
        self.rt.shutdown()
        if self.tp is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        self.post(
            "final",
            metrics=exposition,
            stats=[st.to_json() for st in self.stats],
            leftover_requests=leftover,
            leftover_ids=leftover_ids,
            kv_tracked=kv_tracked,
            unfinished=len(self.requests),
            sends_drained=drained,
            health=_jsonable(health),
        )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def _health(connector: Any) -> dict[str, Any]:
    """``connector.health()``; a check that raised is ``ok: false`` with the error."""
    try:
        return dict(connector.health())
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def stage_main(launch: StageLaunch, inbox: Inbox | None, results: Outbox) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    # Ctrl-C reaches the whole process group: a stage dying of it would leave its connector's backend state
    # (shm slot table, wake file, owner markers) behind. The orchestrator stops the stages ("stop") instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the fork server's launch; ignored is enough
    logging.basicConfig(level=launch.log_level, format=f"%(levelname)s stage{launch.stage_id}.r{launch.rank} %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the orchestrator asks for stacks before killing a stuck stage
    try:
        torch.set_num_threads(1)
        config = PipelineConfig.model_validate(launch.config)
        plan = build_plan(config, filename=launch.filename)
        StageRunner(launch, plan, inbox, results).run()
    except BaseException as exc:
        results.put(
            {
                "kind": "error",
                "stage": launch.stage_id,
                "replica": launch.replica,
                "rank": launch.rank,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )
        raise SystemExit(1) from None
    finally:
        results.close()  # what the stage reported reaches the orchestrator before the process ends
