"""The orchestrator of ``omni-plugins run``: spawn stage processes, feed requests, collect, check, report.

The orchestrator never touches payloads. For each request (at most
``concurrency`` in flight) it picks one replica of every stage (the stage's
``routing`` policy, :mod:`omni_plugins.routing`) and sends the request id and
that route to each of them; a request is complete when every stage rank on its
route reported it done. Then it stops every stage, checks for leaks and builds
a :class:`RunReport`. Every wait is bounded. A stage process that dies is
reported with its stage, replica and exit reason: a replica of a replicated
stage is retired (its requests fail, the others go on); any other death stops
the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_plugins.forkserver import preloaded_context, start_shielded
from omni_plugins.pipeline.leaks import backend_leaks, health_leaks, reclaim, run_id_prefix
from omni_plugins.pipeline.report import RunReport, edge_summary
from omni_plugins.pipeline.spec import PipelinePlan
from omni_plugins.pipeline.stage import StageLaunch, stage_main
from omni_plugins.pipeline.stats import EdgeStats
from omni_plugins.ports import free_port
from omni_plugins.routing import NoReplicaError, ReplicaRouter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunOptions:
    requests: int = 8
    concurrency: int = 2
    timeout_s: float = 600.0  # the whole run
    stall_s: float = 120.0  # no completion for this long: give up
    start_timeout_s: float = 120.0  # every stage ready
    stop_timeout_s: float = 60.0  # every stage reported its final state
    progress: bool = True
    log_level: int = logging.WARNING
    #: a vLLM-Omni file's platforms section to apply (npu, rocm, xpu ...)
    platform: str | None = None


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Proc:
    stage: int
    replica: int
    rank: int
    process: Any
    replicated: bool = False
    ready: bool = False
    final: dict[str, Any] | None = None
    error: str | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stage, self.replica, self.rank)

    @property
    def label(self) -> str:
        replica = f" replica {self.replica}" if self.replicated else ""
        return f"stage {self.stage}{replica} rank {self.rank}"


class _Interrupts:
    """SIGINT (Ctrl-C) during a run, as a flag instead of an exception at an arbitrary point.

    The first asks the run to end: the orchestrator stops and cleans up the stages
    exactly as after a failure, then hands the interrupt to the handler that was
    installed before (:meth:`redeliver`). A second one cuts the wait for stages to
    stop to :data:`HURRY_S` (stuck stages are then killed); neither aborts the
    cleanup half-way. Only in the main thread (where signals arrive), and not when
    SIGINT is ignored.
    """

    HURRY_S = 10.0

    def __init__(self) -> None:
        self.count = 0
        self.hurry_deadline: float | None = None
        self._previous: Any = None
        self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 2:
            self.hurry_deadline = time.monotonic() + self.HURRY_S
            print(f"omni-plugins: interrupted again: stages that have not stopped in {self.HURRY_S:.0f}s are killed", file=sys.stderr)

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handler)
            self._installed = True
        return self

    def redeliver(self) -> None:
        """After an interrupted run: the previous handler's reaction (KeyboardInterrupt by default), KeyboardInterrupt anyway."""
        if callable(self._previous):
            self._previous(signal.SIGINT, None)
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


def _stage_context(connectors: Iterable[str] = ()) -> Any:
    """How stage processes start: ``forkserver`` with torch, the stage module and the ``connectors``' plugins' preload
    modules imported once (see :mod:`omni_plugins.forkserver`)."""
    from omni_plugins.services import preload_modules

    core = ["torch", "omni_plugins.pipeline.stage", "omni_plugins.runtime", "omni_plugins.wire"]
    return preloaded_context([*core, *preload_modules(connectors)])


class Orchestrator:
    def __init__(self, plan: PipelinePlan, options: RunOptions) -> None:
        self.plan = plan
        self.opts = options
        self.ctx = _stage_context(c.name for c in plan.config.connectors.values())
        self.results: Any = self.ctx.Queue()
        #: control queue of each stage replica's rank 0
        self.inboxes: dict[tuple[int, int], Any] = {(s.stage_id, r): self.ctx.Queue() for s in plan.stages for r in range(s.replicas)}
        self.routers = {s.stage_id: ReplicaRouter(s.replicas, s.stage.routing_policy) for s in plan.stages}
        self.procs: list[_Proc] = []
        self.report = RunReport(pipeline=plan.filename, requests=options.requests, concurrency=options.concurrency)
        self.in_flight: set[str] = set()
        self.done: set[str] = set()
        self.routes: dict[str, dict[int, int]] = {}  # request -> the replica of each stage it goes through
        self.progress: dict[str, set[tuple[int, int, int]]] = {}  # request -> stage ranks done with it
        self.dead: set[tuple[int, int, int]] = set()  # processes that ended (handled)
        self.retired: set[tuple[int, int]] = set()  # stage replicas no request goes to any more
        self.per_replica: dict[tuple[int, int], dict[str, int]] = {}
        self.run_tag = uuid.uuid4().hex[:6]
        prefix = run_id_prefix(self.run_tag)
        self.ids = [f"{prefix}{i:05d}" for i in range(options.requests)]
        self.interrupts = _Interrupts()

    # ------------------------------------------------------------------ processes
    def spawn(self) -> None:
        start_shielded(self.ctx)
        data = self.plan.config.model_dump(mode="python")
        for sp in self.plan.stages:
            for replica in range(sp.replicas):
                port = free_port() if sp.stage.tp_size > 1 else None
                for rank in range(sp.stage.tp_size):
                    launch = StageLaunch(data, self.plan.filename, sp.stage_id, rank, port, self.opts.log_level, replica)
                    inbox = self.inboxes[(sp.stage_id, replica)] if rank == 0 else None
                    name = f"omni-stage{sp.stage_id}" + (f"-x{replica}" if sp.replicas > 1 else "") + f"-r{rank}"
                    p = self.ctx.Process(target=stage_main, args=(launch, inbox, self.results), name=name, daemon=True)
                    p.start()
                    self.procs.append(_Proc(sp.stage_id, replica, rank, p, replicated=sp.replicas > 1))

    def _proc(self, stage: int, replica: int, rank: int) -> _Proc | None:
        return next((p for p in self.procs if p.key == (stage, replica, rank)), None)

    def _handle(self, msg: dict[str, Any], bar: Any) -> None:
        kind = msg.get("kind")
        proc = self._proc(int(msg.get("stage", -1)), int(msg.get("replica", 0)), int(msg.get("rank", -1)))
        if kind == "ready" and proc:
            proc.ready = True
        elif kind == "finished":
            self._finished(str(msg["rid"]), msg.get("reason"), proc, bar)
        elif kind == "error" and proc:
            proc.error = str(msg.get("error"))
            logger.debug("%s traceback:\n%s", proc.label, msg.get("traceback"))
        elif kind == "final" and proc:
            proc.final = msg

    def _expected(self, rid: str) -> set[tuple[int, int, int]]:
        """The stage ranks a request goes through, less those that died."""
        route = self.routes[rid]
        return {(s.stage_id, route[s.stage_id], rank) for s in self.plan.stages for rank in range(s.stage.tp_size)} - self.dead

    def _fail(self, rid: str, reason: str) -> None:
        """The request failed: record why, and tell every stage on its route to drop it."""
        if rid in self.report.failed:
            return
        self.report.failed[rid] = reason
        for sid, replica in self.routes[rid].items():
            if (sid, replica) not in self.retired:
                self.inboxes[(sid, replica)].put(("abort", rid))

    def _finished(self, rid: str, reason: Any, proc: _Proc | None, bar: Any) -> None:
        """One stage rank is done with ``rid``; the request completes when every stage rank on its route is."""
        if rid not in self.in_flight:
            self.report.problems.append(f"{proc.label if proc else '?'}: report about unknown or finished request {rid}")
            return
        if reason:
            self._fail(rid, str(reason))
        ranks = self.progress.setdefault(rid, set())
        ranks.add(proc.key if proc else (-1, -1, -1))
        self._maybe_complete(rid, bar)

    def _maybe_complete(self, rid: str, bar: Any) -> None:
        if not self.progress.get(rid, set()) >= self._expected(rid):
            return
        self.progress.pop(rid, None)
        self.in_flight.discard(rid)
        self.done.add(rid)
        ok = rid not in self.report.failed
        for sid, replica in self.routes[rid].items():
            self.routers[sid].done(replica)
            if self.plan.plan(sid).replicas > 1:
                counts = self.per_replica.setdefault((sid, replica), {"routed": 0, "completed": 0, "failed": 0})
                counts["completed" if ok else "failed"] += 1
        if ok:
            self.report.completed += 1
        bar.update(1)

    def _pump(self, timeout: float, bar: Any) -> None:
        try:
            msg = self.results.get(timeout=timeout)
        except queue.Empty:
            return
        self._handle(msg, bar)
        while True:
            try:
                msg = self.results.get_nowait()
            except queue.Empty:
                return
            self._handle(msg, bar)

    def _dead(self, *, expected: bool = False) -> list[str]:
        """Processes that ended (unexpectedly unless ``expected``), described."""
        out = []
        for p in self.procs:
            code = p.process.exitcode
            if code is None or (expected and code == 0 and p.final is not None):
                continue
            if code == 0 and p.final is not None:
                continue
            out.append(self._describe_death(p))
        return out

    def _describe_death(self, p: _Proc) -> str:
        why = exit_reason(p.process.exitcode)
        if p.error:
            why += f" ({p.error})"
        return f"{p.label} (pid {p.process.pid}) died: {why}"

    def _deaths(self, bar: Any) -> bool:
        """Handle processes that died since the last look; False when the run cannot go on.

        A replica of a replicated stage that still has a live replica is retired: no request is
        routed to it any more, its other TP ranks are stopped, and the requests routed to it fail
        (with stage, replica and reason); the others go on. Any other death ends the run.
        """
        fatal = False
        for p in self.procs:
            if p.key in self.dead or p.process.exitcode is None or (p.process.exitcode == 0 and p.final is not None):
                continue
            self.dead.add(p.key)
            death = self._describe_death(p)
            self.report.deaths.append(death)
            sp = self.plan.plan(p.stage)
            others = [r for r in range(sp.replicas) if r != p.replica and (p.stage, r) not in self.retired]
            if (p.stage, p.replica) in self.retired:
                continue
            if sp.replicas == 1 or not others:
                fatal = True
                continue
            self._retire(p, death, bar)
        return not fatal

    def _retire(self, p: _Proc, death: str, bar: Any) -> None:
        self.retired.add((p.stage, p.replica))
        self.routers[p.stage].retire(p.replica)
        logger.warning("%s; replica %d of stage %d retired, its requests fail", death, p.replica, p.stage)
        for sibling in self.procs:  # a TP group missing a rank cannot go on
            if (sibling.stage, sibling.replica) == (p.stage, p.replica) and sibling.key != p.key:
                if sibling.process.exitcode is None:
                    sibling.process.kill()
                    sibling.process.join(5)
                self.dead.add(sibling.key)
        for rid in sorted(self.in_flight):
            if self.routes[rid].get(p.stage) == p.replica:
                self._fail(rid, f"stage {p.stage} replica {p.replica} died: {exit_reason(p.process.exitcode)}")
                self._maybe_complete(rid, bar)

    # ------------------------------------------------------------------ run
    def run(self) -> RunReport:
        from tqdm import tqdm

        started = time.monotonic()
        bar = tqdm(total=self.opts.requests, desc="requests", unit="req", file=sys.stderr, disable=not self.opts.progress, leave=False)
        with self.interrupts:
            try:
                self.spawn()
                if self._wait_ready(bar):
                    self._feed(bar, started)
            finally:
                bar.close()
                self._stop_all(bar)
                self._count_lost()
                self.report.duration_s = time.monotonic() - started
        if self.interrupts.count:
            self.interrupts.redeliver()
        self._collect()
        return self.report

    def _count_lost(self) -> None:
        """Lost: neither completed nor failed. Counted after stopping, on every path (stages may report while stopping)."""
        self.report.lost = [rid for rid in self.ids if rid not in self.done and rid not in self.report.failed]

    def _wait_ready(self, bar: Any) -> bool:
        deadline = time.monotonic() + self.opts.start_timeout_s
        while not all(p.ready for p in self.procs):
            if self.interrupts.count:
                return False
            dead = self._dead()
            if dead:
                self.report.deaths += dead
                self.dead |= {p.key for p in self.procs if p.process.exitcode is not None}
                return False
            if time.monotonic() > deadline:
                slow = [p.label for p in self.procs if not p.ready]
                self.report.problems.append(f"stages not ready after {self.opts.start_timeout_s:.0f}s: {', '.join(slow)}")
                return False
            self._pump(0.1, bar)
        return True

    def _admit(self, rid: str) -> None:
        route = {s.stage_id: self.routers[s.stage_id].pick() for s in self.plan.stages}
        self.routes[rid] = route
        self.in_flight.add(rid)
        message = ("admit", rid, {str(sid): replica for sid, replica in route.items()})  # str keys: TP ranks wire-encode it
        for sid, replica in route.items():
            if self.plan.plan(sid).replicas > 1:
                self.per_replica.setdefault((sid, replica), {"routed": 0, "completed": 0, "failed": 0})["routed"] += 1
            self.inboxes[(sid, replica)].put(message)

    def _feed(self, bar: Any, started: float) -> None:
        pending = list(reversed(self.ids))
        last_progress = time.monotonic()
        while (pending or self.in_flight) and not self.interrupts.count:
            while pending and len(self.in_flight) < self.opts.concurrency:
                try:
                    self._admit(pending[-1])
                except NoReplicaError as exc:
                    self.report.problems.append(str(exc))
                    return
                pending.pop()
            before = len(self.done)
            self._pump(0.05, bar)
            now = time.monotonic()
            if len(self.done) != before:
                last_progress = now
            if not self._deaths(bar):
                break
            if now - started > self.opts.timeout_s:
                self.report.problems.append(f"run timed out after {self.opts.timeout_s:.0f}s")
                break
            if now - last_progress > self.opts.stall_s:
                self.report.problems.append(f"no request completed for {self.opts.stall_s:.0f}s")
                break

    def _stop_all(self, bar: Any) -> None:
        for q in self.inboxes.values():
            q.put(("stop",))
        deadline = time.monotonic() + self.opts.stop_timeout_s

        def left() -> float:
            hurry = self.interrupts.hurry_deadline
            return (deadline if hurry is None else min(deadline, hurry)) - time.monotonic()

        while left() > 0:
            if all(p.final is not None or p.process.exitcode is not None for p in self.procs):
                break
            self._pump(0.1, bar)
        for p in self.procs:
            p.process.join(max(0.1, min(10.0, left())))
        self._pump(0.05, bar)
        for p in self.procs:
            if p.process.exitcode is None and p.final is not None:
                p.process.join(10)  # done and exiting: let it finish
        stuck = [p for p in self.procs if p.process.exitcode is None]
        for p in stuck:
            with contextlib.suppress(OSError):
                os.kill(p.process.pid, signal.SIGUSR1)  # its thread stacks go to stderr
        if stuck:
            time.sleep(0.5)
        for p in stuck:
            if p.process.exitcode is None:
                self.report.problems.append(f"{p.label} did not stop; killed (thread stacks on stderr)")
                p.process.kill()
                p.process.join(5)
        known = set(self.report.deaths)
        for p in self.procs:
            if p.key in self.dead:
                continue
            d = self._dead_one(p)
            if d is not None and d not in known:
                self.report.deaths.append(d)
        for q in [*self.inboxes.values(), self.results]:
            q.close()
            q.join_thread()

    def _dead_one(self, p: _Proc) -> str | None:
        code = p.process.exitcode
        if code is None or (code == 0 and p.final is not None):
            return None
        return self._describe_death(p)

    # ------------------------------------------------------------------ report
    def _collect(self) -> None:
        edges: dict[str, EdgeStats] = {}
        order: list[str] = []
        for p in self.procs:
            final = p.final
            if final is None:
                continue
            where = p.label
            self.report.stages.append(
                {
                    "stage": p.stage,
                    "replica": p.replica,
                    "rank": p.rank,
                    "leftover_requests": final["leftover_requests"],
                    "kv_tracked": final["kv_tracked"],
                    "health": final["health"],
                }
            )
            if final["leftover_requests"]:
                self.report.leaks.append(
                    f"{where}: runtime still holds {final['leftover_requests']} request state(s): {final['leftover_ids']}"
                )
            if final["kv_tracked"]:
                self.report.leaks.append(f"{where}: KV manager still tracks {final['kv_tracked']}")
            if not final["sends_drained"]:
                self.report.problems.append(f"{where}: queued sends did not drain")
            for instance, health in final["health"].items():
                self.report.leaks += health_leaks(f"{where} ({instance!r})", health)
            for raw in final["stats"]:
                st = EdgeStats.from_json(raw)
                if st.kind == "payload" and p.rank != 0:
                    # payloads are moved by rank 0; a follower checks the broadcast copy: count only what it found wrong
                    st = EdgeStats(st.edge, mismatches=st.mismatches, errors=[f"rank {p.rank}: {e}" for e in st.errors])
                if st.edge not in edges:
                    edges[st.edge] = EdgeStats(st.edge, kind=st.kind)
                    order.append(st.edge)
                edges[st.edge].merge(st)
        used = self.plan.connectors()
        self.report.leaks += backend_leaks(self.plan.config, used, self.run_tag)
        # whatever was left (a stage killed, a run interrupted) is reported above and then freed here,
        # so no run leaves segments or keys behind; only provably stale or this run's data is touched
        self.report.reclaimed = reclaim(self.plan.config, used, self.run_tag)
        self.report.edges = [edge_summary(edges[name]) for name in order]
        self.report.replicas = [
            {"stage": sid, "replica": r, "alive": (sid, r) not in self.retired, **self.per_replica.get((sid, r), {"routed": 0, "completed": 0, "failed": 0})}
            for sid, r in sorted(self.inboxes)
            if self.plan.plan(sid).replicas > 1
        ]


def run_pipeline(path: str | Path, options: RunOptions) -> RunReport:
    """Load, validate and run ``path``; the report says whether everything arrived intact and nothing leaked."""
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.pipeline.checks import plan_for_run

    config = load_pipeline_config(path, platform=options.platform)
    plan = plan_for_run(config, filename=str(path))
    return Orchestrator(plan, options).run()
