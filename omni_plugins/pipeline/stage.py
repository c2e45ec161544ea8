"""One stage rank of ``omni-plugins run``: a synthetic model driving a :class:`StageTransferRuntime`.

Runs in its own (spawned) process. Control messages -- never payloads --
arrive on ``inbox`` (rank 0 only: ``("admit", request_id)`` and
``("stop",)``) and go to the orchestrator on ``results``. Payloads travel
only through the runtime's connector. With ``tp_size > 1`` the ranks form a
gloo process group; rank 0 broadcasts each step's plan (admissions, stop) so
the ranks call the runtime's collective methods in lockstep.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from omni_plugins.config.models import PipelineConfig
from omni_plugins.errors import ConnectorError
from omni_plugins.pipeline.builders import BUILDER_PATH
from omni_plugins.pipeline.checksums import step_output
from omni_plugins.pipeline.inputs import InputCheck
from omni_plugins.pipeline.kvsynth import check_kv, paged_cache
from omni_plugins.pipeline.spec import PipelinePlan, StagePlan, build_plan
from omni_plugins.pipeline.stats import EdgeStats

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
    dist_port: int | None = None
    log_level: int = logging.WARNING


@dataclass
class SynthRequest:
    """The request object the runtime and the payload builder see."""

    request_id: str
    external_req_id: str
    finished: bool = False

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class _Req:
    """One request on this stage rank: input progress, output progress, KV."""

    request: SynthRequest
    admitted: float = field(default_factory=time.monotonic)
    seen: int = 0  # upstream steps verified
    input_finished: bool = False  # the stream ended / the full payload arrived
    produced: int = 0
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)  # full-payload steps when the runtime does not accumulate
    kv_in: bool = False
    kv_sent: bool = False
    failed: str | None = None

    @property
    def rid(self) -> str:
        return self.request.request_id


class StageRunner:
    """The model loop of one stage rank."""

    def __init__(self, launch: StageLaunch, plan: PipelinePlan, inbox: Any, downstream: Any, results: Any) -> None:
        from omni_plugins.runtime import StageTransferRuntime

        self.launch = launch
        self.plan = plan
        self.me: StagePlan = plan.plan(launch.stage_id)
        self.rank = launch.rank
        self.leader = launch.rank == 0
        self.inbox, self.downstream, self.results = inbox, downstream, results
        self.up: StagePlan | None = plan.plan(self.me.upstream) if self.me.upstream is not None else None
        self.tp = self._tp_group()
        stage = self.me.stage
        if self.me.downstream is not None and self.me.synthetic.outputs:
            stage = stage.model_copy(
                update={
                    "custom_process_next_stage_input_func": BUILDER_PATH,
                    "model_stage": stage.model_stage or f"synthetic-{stage.stage_id}",
                }
            )
        if stage.kv_layout == "auto":
            stage = stage.model_copy(update={"kv_layout": "nhd"})  # the synthetic caches are built NHD
        kwargs: dict[str, Any] = {"tp_group": self.tp} if self.tp is not None else {}
        if self.tp is None and stage.tp_size > 1:
            kwargs["local_rank"] = self.rank
        self.rt = StageTransferRuntime(stage, plan.config.stage_connector_config(stage.stage_id), **kwargs)
        self.requests: dict[str, _Req] = {}
        self.aborted: set[str] = set()
        self.stop = False
        tag = f"{self.up.stage_id}->{self.me.stage_id}" if self.up else ""
        conn = self.me.connector or "-"
        mode = "stream" if self.me.stage.async_chunk else "full"
        self.payload_stats = EdgeStats(f"{tag} {conn} ({mode})")
        self.kv_stats = EdgeStats(f"{tag} {conn} (KV)")
        self.input: InputCheck | None = None
        if self.up is not None:
            merged = self.me.stage.async_chunk and self.me.stage.worker_type == "ar"
            self.input = InputCheck(self.up, merged=merged, stats=self.payload_stats)
        self.expects_kv = self.up is not None and self.up.synthetic.kv is not None
        self.sends = self.me.downstream is not None and bool(self.me.synthetic.outputs)

    def _tp_group(self) -> Any:
        if self.me.stage.tp_size == 1:
            return None
        import torch.distributed as dist

        from omni_plugins.runtime import TorchDistributedGroup

        os.environ["LOCAL_RANK"] = str(self.rank)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{self.launch.dist_port}",
            rank=self.rank,
            world_size=self.me.stage.tp_size,
            timeout=timedelta(seconds=120),
        )
        return TorchDistributedGroup()

    def post(self, kind: str, **data: Any) -> None:
        self.results.put({"kind": kind, "stage": self.me.stage_id, "rank": self.rank, **data})

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
                    plan["admit"].append(msg[1])
                elif msg[0] == "abort":
                    plan["abort"].append(msg[1])
                elif msg[0] == "stop":
                    plan["stop"] = True
        if self.tp is not None:
            plan = self.tp.broadcast_object(plan, src=0)
        return plan

    def _admit(self, rid: str) -> None:
        req = _Req(SynthRequest(rid, rid))
        self.requests[rid] = req
        if rid in self.aborted:
            self.aborted.discard(rid)
            req.failed = f"stage {self.me.stage_id} rank {self.rank}: aborted (failed elsewhere)"
            if self.leader and self.downstream is not None:
                self.downstream.put(("admit", rid))
            self._finish(req)
            return
        if self.up is not None:
            self.rt.register_chunk_recv(req.request)
        if self.leader and self.downstream is not None:
            self.downstream.put(("admit", rid))

    # ------------------------------------------------------------------ receive
    def _receive(self) -> bool:
        progress = False
        if self.up is None or self.input is None:
            signals = self.rt.collect_signals()
        elif self.me.stage.async_chunk:
            # recv_chunk() before collect_signals(): collecting drains the wake flags recv_chunk reads. On TP
            # followers recv_chunk() is always empty; they read what the leader broadcast in collect_signals().
            got = self.rt.recv_chunk() if self.leader else {}
            signals = self.rt.collect_signals()
            # arrived between the two calls; a finished stream is read from the cache even when recv_chunk
            # returned it, since its last chunk may have landed in between (an "ar" accumulation only grows)
            for rid in (signals.chunk_ready - got.keys()) | signals.chunk_finished:
                got[rid] = self.rt.get_local_stage_payload(rid)
            for rid, payload in got.items():
                req = self.requests.get(rid)
                if self.me.stage.worker_type == "generation":
                    self.rt.pop_local_stage_payload(rid)
                if req is None or payload is None:
                    continue
                req.seen = self.input.check(rid, payload, req.seen)
                progress = True
            for rid in signals.chunk_finished:
                req = self.requests.get(rid)
                if req is not None:
                    req.input_finished = True
                    progress = True
        else:
            got = self.rt.recv_full_payload_inputs()
            signals = self.rt.collect_signals()
            for rid, payload in got.items():
                req = self.requests.get(rid)
                if req is None:
                    continue
                req.seen = self.input.check(rid, payload, req.seen)
                req.input_finished = True
                progress = True
        for rid in signals.failed | signals.timed_out:
            req = self.requests.get(rid)
            if req is not None:
                why = "timed out waiting for input" if rid in signals.timed_out else "the runtime reported it failed"
                req.failed = req.failed or f"stage {self.me.stage_id} rank {self.rank}: {why}"
                progress = True
        return progress

    def _receive_kv(self, req: _Req) -> None:
        manager = self.rt.kv_manager
        assert self.up is not None and manager is not None
        payload, size = manager.receive_kv_cache_for_request(req.rid, timeout_s=KV_POLL_S, keep_partial=True)
        if payload is None:
            return
        req.kv_in = True
        if not check_kv(self.up, req.rid, payload, size, to_tp=self.me.stage.tp_size, rank=self.rank, stats=self.kv_stats):
            req.failed = f"stage {self.me.stage_id} rank {self.rank}: KV mismatch"

    # ------------------------------------------------------------------ produce
    def _allowed_steps(self, req: _Req) -> int:
        steps = self.me.synthetic.steps
        if self.input is None or req.input_finished:
            return steps
        return min(steps, req.seen * steps // max(1, self.input.total_steps))

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
                req.failed = f"stage {self.me.stage_id}: chunk {k} of {req.rid} was not enqueued"
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
        if self.input is not None:
            if not req.input_finished:
                return False
            if req.seen != self.input.total_steps:
                req.failed = f"stage {self.me.stage_id}: input ended after {req.seen} of {self.input.total_steps} steps"
                return True
        if self.expects_kv and not req.kv_in:
            self._receive_kv(req)
            if not req.kv_in:
                return False
        return not self.sends or req.produced >= self.me.synthetic.steps

    def _finish(self, req: _Req) -> None:
        del self.requests[req.rid]
        self.rt.cleanup_finished_request(req.rid, aborted=req.failed is not None)
        # every rank of every stage reports: a request is complete when all of them are done with it
        self.post("finished", rid=req.rid, reason=req.failed)

    # ------------------------------------------------------------------ loop
    def check_backend(self) -> None:
        """Fail at start, not at the run's timeout, when the connector cannot reach its backend.

        The test is the connector's ``health()``: ``ok`` false *with* an ``error`` (the check itself
        failed, e.g. a connection refused). ``ok`` false without one (a peer not started yet, a stale
        announcement) may heal once every stage runs, so it is only logged.
        """
        connector = self.rt.connector
        if connector is None:
            return
        health = _health(connector)
        if health.get("ok", True):
            return
        if health.get("error"):
            self.rt.shutdown()
            raise ConnectorError(f"connector {self.me.connector!r} ({connector.name}) cannot reach its backend: {health['error']}")
        logger.info("connector %r reports not ok at start (continuing): %s", self.me.connector, health)

    def run(self) -> None:
        self.check_backend()
        self.post("ready", pid=os.getpid())
        idle = True
        step_s = self.me.synthetic.step_ms / 1000.0
        while True:
            plan = self._control(idle)
            for rid in plan["admit"]:
                self._admit(rid)
            for rid in plan["abort"]:
                req = self.requests.get(rid)
                if req is None:
                    self.aborted.add(rid)  # not admitted here yet
                else:
                    req.failed = req.failed or f"stage {self.me.stage_id} rank {self.rank}: aborted (failed elsewhere)"
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
            if idle and self.requests and self.up is not None and self.tp is None:
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
        kv_tracked = self.rt.kv_manager.tracked_request_ids() if self.rt.kv_manager is not None else []
        connector = self.rt.connector
        health = _health(connector) if connector is not None else {}
        self.rt.shutdown()
        if self.tp is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
        self.post(
            "final",
            stats=[self.payload_stats.to_json(), self.kv_stats.to_json()] if self.up is not None else [],
            kv=self.expects_kv,
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


def stage_main(launch: StageLaunch, inbox: Any, downstream: Any, results: Any) -> None:
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
        StageRunner(launch, plan, inbox, downstream, results).run()
    except BaseException as exc:
        results.put(
            {
                "kind": "error",
                "stage": launch.stage_id,
                "rank": launch.rank,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )
        raise SystemExit(1) from None
