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

Across hosts (:class:`Coordination`) this orchestrator runs on the
coordinating host: it serves the control channel
(:mod:`omni_plugins.pipeline.control`); every other host joins it and runs its
own stages (:mod:`omni_plugins.pipeline.agent`), which the orchestrator drives
exactly like its own (:mod:`omni_plugins.pipeline.hosts`). A host that is lost
takes its processes with it: the requests routed through its stages fail
naming it, and the run stops as after any other death. Once the stages
stopped, every host checks and reclaims the backends it is responsible for
(:func:`~omni_plugins.pipeline.hosts.census_plan`) and reports back.
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_plugins.config.placement import cross_host_errors
from omni_plugins.pipeline.control import HOST_TIMEOUT_S, VERSION, ControlLink, ControlServer
from omni_plugins.pipeline.hosts import HostDirectory, RemoteHost, RemoteInbox, RemoteProcess, census_plan
from omni_plugins.pipeline.leaks import backend_leaks, health_leaks, reclaim, run_id_prefix
from omni_plugins.pipeline.local import LocalStages, drain, stage_label
from omni_plugins.pipeline.report import RunReport, edge_summary
from omni_plugins.pipeline.spec import PipelinePlan
from omni_plugins.pipeline.stats import EdgeStats
from omni_plugins.routing import NoReplicaError, ReplicaRouter

logger = logging.getLogger(__name__)

#: how long the coordinating host waits for every other host's leak check
COLLECT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RunOptions:
    requests: int = 8
    concurrency: int = 2
    timeout_s: float = 600.0  # the whole run
    stall_s: float = 120.0  # no completion for this long: give up
    start_timeout_s: float = 120.0  # every stage ready (across hosts: every host joined, too)
    stop_timeout_s: float = 60.0  # every stage reported its final state
    progress: bool = True
    log_level: int = logging.WARNING
    #: a vLLM-Omni file's platforms section to apply (npu, rocm, xpu ...)
    platform: str | None = None
    #: serve this host's stage metrics on ``metrics_host:metrics_port`` (None: no metrics; 0: any free port)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: a host silent this long is lost (across hosts only)
    host_timeout_s: float = HOST_TIMEOUT_S


@dataclass(frozen=True)
class Coordination:
    """This host coordinates a pipeline across hosts: it runs ``local_stages`` and serves the control channel on ``serve``.

    ``expected``: the other hosts and their stages (the YAML's ``placement``), or None:
    any host may join with stages this one does not run, until every stage runs somewhere.
    """

    here: str
    local_stages: tuple[int, ...]
    serve: str
    secret: bytes = field(repr=False)
    digest: str
    expected: dict[str, list[int]] | None = None


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
    #: the host it runs on, in a run across hosts (None: a single-host run)
    host: str | None = None
    #: its ``stage`` label in metrics
    metrics_label: str | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.stage, self.replica, self.rank)

    @property
    def label(self) -> str:
        replica = f" replica {self.replica}" if self.replicated else ""
        on = f" on host {self.host}" if self.host is not None else ""
        return f"stage {self.stage}{replica} rank {self.rank}{on}"

    @property
    def started(self) -> bool:
        """It exists: a local process, or a remote one whose host joined."""
        return not isinstance(self.process, RemoteProcess) or self.process.host is not None

    @property
    def why(self) -> str:
        """Why it ended: its host was lost, or its exit reason."""
        lost = getattr(self.process, "lost", None)
        return str(lost) if lost else exit_reason(self.process.exitcode)


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


class Orchestrator:
    def __init__(self, plan: PipelinePlan, options: RunOptions, coordination: Coordination | None = None) -> None:
        self.plan = plan
        self.opts = options
        self.coord = coordination
        here = coordination.here if coordination is not None else None
        local = list(coordination.local_stages) if coordination is not None else [s.stage_id for s in plan.stages]
        self.local = LocalStages(plan, local, log_level=options.log_level, metrics=options.metrics_port is not None)
        self.ctx = self.local.ctx
        #: everything the orchestrator reacts to: stage reports (dicts) and control-channel events (tuples)
        self.events: queue.Queue[Any] = queue.Queue()
        self.directory = HostDirectory(here or "", local)
        #: control queue of each stage replica's rank 0 (on another host: through its control link)
        self.inboxes: dict[tuple[int, int], Any] = {
            (s.stage_id, r): self.local.inboxes.get((s.stage_id, r)) or RemoteInbox(self.directory, s.stage_id, r)
            for s in plan.stages
            for r in range(s.replicas)
        }
        self.routers = {s.stage_id: ReplicaRouter(s.replicas, s.stage.routing_policy) for s in plan.stages}
        self.procs: list[_Proc] = []
        for sp in plan.stages:  # every stage process of the run, wherever it runs
            tp = sp.stage.tp_size > 1
            remote = sp.stage_id not in self.directory.local
            for replica in range(sp.replicas):
                for rank in range(sp.stage.tp_size):
                    label = stage_label(sp.stage_id, replica, rank, replicated=sp.replicas > 1, tp=tp)
                    process: Any = RemoteProcess(sp.stage_id, replica, rank) if remote else None  # local: set by spawn()
                    host = None if remote else here
                    self.procs.append(_Proc(sp.stage_id, replica, rank, process, sp.replicas > 1, host=host, metrics_label=label))
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
        self.server: ControlServer | None = None
        self.host_metrics: Any = None
        self.refused: list[str] = []  # joins refused (why), for the not-ready message
        self.feeding = False
        self._bar: Any = None

    # ------------------------------------------------------------------ processes
    def spawn(self) -> None:
        if self.opts.metrics_port is not None:
            from omni_plugins.pipeline.hostmetrics import HostMetrics

            self.host_metrics = HostMetrics()
            port = self.host_metrics.serve(self.opts.metrics_port, self.opts.metrics_host)
            self.report.metrics = f"http://{self.opts.metrics_host}:{port}/metrics"
            print(f"omni-plugins: stage metrics on {self.report.metrics}", file=sys.stderr)
        if self.coord is not None:
            self.server = ControlServer(
                self.coord.serve, self.coord.secret, lambda link, hello: self.events.put(("join", link, hello)), timeout_s=self.opts.host_timeout_s
            )
            print(f"omni-plugins: host {self.coord.here} serves the control channel on {self.server.address}", file=sys.stderr)
        for spawned in self.local.spawn():
            proc = self._proc(spawned.stage, spawned.replica, spawned.rank)
            assert proc is not None
            proc.process = spawned.process

    def _proc(self, stage: int, replica: int, rank: int) -> _Proc | None:
        return next((p for p in self.procs if p.key == (stage, replica, rank)), None)

    def _handle(self, msg: Any, bar: Any) -> None:
        if isinstance(msg, tuple):
            self._control_event(msg)
            return
        kind = msg.get("kind")
        proc = self._proc(int(msg.get("stage", -1)), int(msg.get("replica", 0)), int(msg.get("rank", -1)))
        if self.host_metrics is not None and proc is not None and not isinstance(proc.process, RemoteProcess):
            self.host_metrics.note(msg, proc.metrics_label)
        if kind == "ready" and proc:
            proc.ready = True
        elif kind == "finished":
            self._finished(str(msg["rid"]), msg.get("reason"), proc, bar)
        elif kind == "error" and proc:
            proc.error = str(msg.get("error"))
            logger.debug("%s traceback:\n%s", proc.label, msg.get("traceback"))
        elif kind == "final" and proc:
            proc.final = msg

    # ------------------------------------------------------------------ other hosts
    def _control_event(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "join":
            self._join(event[1], event[2])
        elif kind == "stage":
            self._handle(event[2], self._bar)
        elif kind == "exited":
            host = self.directory.hosts.get(event[1])
            msg = event[2]
            proc = self._remote(host, (int(msg["stage"]), int(msg["replica"]), int(msg["rank"]))) if host is not None else None
            if proc is not None:
                proc.exited(int(msg["code"]))
        elif kind == "collected":
            host = self.directory.hosts.get(event[1])
            if host is not None:
                host.collected = event[2]
        elif kind == "lost":
            host = self.directory.hosts.get(event[1])
            logger.warning("host %s (%s) lost: %s", event[1], host.address if host else "?", event[2])

    def _join_error(self, name: str, stages: list[int], hello: dict[str, Any]) -> str | None:
        coord = self.coord
        assert coord is not None
        if hello.get("version") != VERSION:
            return f"control protocol {hello.get('version')!r}, this host speaks {VERSION}: run the same omni-plugins version on every host"
        if hello.get("pipeline") != coord.digest:
            return f"host {name!r} runs a different pipeline file than host {coord.here!r} (its sha256 differs): run the same YAML on every host"
        if self.feeding:
            return "the run has started; a host joins before it does"
        if name == coord.here or name in self.directory.hosts:
            return f"a host named {name!r} has joined already; give each host its own name (--host)"
        if coord.expected is not None:
            if name not in coord.expected:
                return f"host {name!r} is not in the pipeline's placement (hosts: {', '.join([coord.here, *coord.expected])})"
            if sorted(coord.expected[name]) != stages:
                return f"host {name!r} says it runs stages {stages}, the placement gives it {sorted(coord.expected[name])}"
        if not stages:
            return f"host {name!r} runs no stage"
        known = {s.stage_id for s in self.plan.stages}
        for sid in stages:
            if sid not in known:
                return f"host {name!r} says it runs stage {sid}; the pipeline's stages are {sorted(known)}"
            elsewhere = self.directory.name_of(sid)
            if elsewhere is not None:
                return f"stage {sid} runs on host {elsewhere!r} already; host {name!r} cannot run it too"
        errors = cross_host_errors(self.plan.config, {**self.directory.layout(), name: stages}, self.plan.filename)
        return "\n".join(errors) if errors else None

    def _join(self, link: ControlLink, hello: dict[str, Any]) -> None:
        """A host authenticated and said which stages it runs: take it on, or tell it why not."""
        name = str(hello.get("host", ""))
        try:
            stages = sorted(int(s) for s in hello.get("stages", []))
        except (TypeError, ValueError):
            stages = []
        error = self._join_error(name, stages, hello)
        if error is not None:
            logger.warning("refused host %r from %s: %s", name, link.peer, error)
            self.refused.append(f"host {name!r} from {link.peer}: {error}")
            link.send({"op": "refused", "error": error})
            link.close("refused")
            return
        host = RemoteHost(name, stages, link)
        self.directory.hosts[name] = host
        for p in self.procs:
            if p.stage in stages and isinstance(p.process, RemoteProcess):
                p.host = name
                p.process.host = host
                host.procs.append(p.process)
        link.send({"op": "welcome", "run_tag": self.run_tag, "coordinator": self.directory.here})
        link.start(lambda m: self._from_host(host, m), lambda why: self._host_lost(host, why), name=f"omni-control-{name}")
        print(f"omni-plugins: host {name} ({link.peer}) joined with stage(s) {', '.join(map(str, stages))}", file=sys.stderr)

    def _from_host(self, host: RemoteHost, msg: dict[str, Any]) -> None:
        """A message from a host (its link's reader thread): process facts at once, the rest to the main loop."""
        op = msg.get("op")
        if op == "spawned":
            for stage, replica, rank, pid in msg.get("procs", []):
                proc = self._remote(host, (int(stage), int(replica), int(rank)))
                if proc is not None:
                    proc.pid = int(pid)

        elif op == "exited":  # after the process's last report (one link, in order): handled in the same order
            self.events.put(("exited", host.name, msg))
        elif op == "stage" and isinstance(msg.get("msg"), dict):
            self.events.put(("stage", host.name, msg["msg"]))
        elif op == "collected":
            self.events.put(("collected", host.name, msg))

    def _remote(self, host: RemoteHost, key: tuple[int, int, int]) -> RemoteProcess | None:
        return next((p for p in host.procs if p.key == key), None)

    def _host_lost(self, host: RemoteHost, why: str) -> None:
        host.lost = why
        for proc in host.procs:
            proc.host_lost(f"host {host.name} ({host.address}) lost: {why}")
        self.events.put(("lost", host.name, why))

    def _disconnect(self) -> None:
        """Tell every host how the run ended (it prints the report and exits), close the links and the listener."""
        table, ok = self.report.table(), self.report.ok
        for host in self.directory.hosts.values():
            if host.lost is None:
                host.link.send({"op": "bye", "ok": ok, "table": table})
            host.link.close("the run ended")
        if self.server is not None:
            self.server.close()

    def close_metrics(self) -> None:
        """Stop serving the host's metrics (kept after :meth:`run`, so the final counts stay scrapeable)."""
        if self.host_metrics is not None:
            self.host_metrics.close()

    # ------------------------------------------------------------------ requests
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
        """Handle what the control channel brought, then the local stages' reports (waiting up to ``timeout`` s for one)."""
        handle = lambda msg: self._handle(msg, bar)  # noqa: E731
        drain(self.events, handle, 0)
        if self.local.stage_ids and not self.local.closed:
            self.local.reports(handle, timeout)
        else:
            drain(self.events, handle, timeout)
        drain(self.events, handle, 0)

    def _join_process(self, p: _Proc, timeout: float) -> None:
        """Wait up to ``timeout`` s for ``p`` to exit (a remote one: while handling what its host reports)."""
        if not isinstance(p.process, RemoteProcess):
            p.process.join(timeout)
            return
        deadline = time.monotonic() + timeout
        while p.process.exitcode is None and time.monotonic() < deadline:
            self._pump(0.05, self._bar)

    def _dead(self, *, expected: bool = False) -> list[str]:
        """Processes that ended (unexpectedly unless ``expected``), described."""
        out = []
        for p in self.procs:
            if not p.started:
                continue
            code = p.process.exitcode
            if code is None or (expected and code == 0 and p.final is not None):
                continue
            if code == 0 and p.final is not None:
                continue
            out.append(self._describe_death(p))
        return out

    def _describe_death(self, p: _Proc) -> str:
        why = p.why
        if p.error:
            why += f" ({p.error})"
        return f"{p.label} (pid {p.process.pid}) died: {why}"

    def _deaths(self, bar: Any) -> bool:
        """Handle processes that died since the last look; False when the run cannot go on.

        A replica of a replicated stage that still has a live replica is retired: no request is
        routed to it any more, its other TP ranks are stopped, and the requests routed to it fail
        (with stage, replica and reason); the others go on. Any other death ends the run; when a
        host was lost, the requests routed through its stages fail naming it.
        """
        fatal = False
        for p in self.procs:
            if p.key in self.dead or not p.started or p.process.exitcode is None or (p.process.exitcode == 0 and p.final is not None):
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
                if getattr(p.process, "lost", None):
                    for rid in sorted(self.in_flight):
                        if self.routes[rid].get(p.stage) == p.replica:
                            self._fail(rid, f"{p.label}: {p.why}")
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
                    self._join_process(sibling, 5)
                self.dead.add(sibling.key)
        for rid in sorted(self.in_flight):
            if self.routes[rid].get(p.stage) == p.replica:
                self._fail(rid, f"stage {p.stage} replica {p.replica} died: {p.why}")
                self._maybe_complete(rid, bar)

    # ------------------------------------------------------------------ run
    def run(self) -> RunReport:
        from tqdm import tqdm

        started = time.monotonic()
        bar = self._bar = tqdm(total=self.opts.requests, desc="requests", unit="req", file=sys.stderr, disable=not self.opts.progress, leave=False)
        try:
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
        finally:
            self._disconnect()
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
                self.dead |= {p.key for p in self.procs if p.started and p.process.exitcode is not None}
                return False
            if time.monotonic() > deadline:
                slow = [p.label if p.started else f"{p.label} (no host joined to run it)" for p in self.procs if not p.ready]
                problem = f"stages not ready after {self.opts.start_timeout_s:.0f}s: {', '.join(slow)}"
                if self.refused:
                    problem += "; refused: " + "; ".join(self.refused)
                self.report.problems.append(problem)
                return False
            self._pump(0.1, bar)
        self.feeding = True
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
        self.feeding = True  # no host joins any more
        for q in self.inboxes.values():
            q.put(("stop",))
        deadline = time.monotonic() + self.opts.stop_timeout_s
        started = [p for p in self.procs if p.started and p.process is not None]

        def left() -> float:
            hurry = self.interrupts.hurry_deadline
            return (deadline if hurry is None else min(deadline, hurry)) - time.monotonic()

        while left() > 0:
            if all(p.final is not None or p.process.exitcode is not None for p in started):
                break
            self._pump(0.1, bar)
        for p in started:
            self._join_process(p, max(0.1, min(10.0, left())))
        self._pump(0.05, bar)
        for p in started:
            if p.process.exitcode is None and p.final is not None:
                self._join_process(p, 10)  # done and exiting: let it finish
        stuck = [p for p in started if p.process.exitcode is None]
        for p in stuck:
            p.process.dump_stacks()  # its thread stacks go to its host's stderr
        if stuck:
            time.sleep(0.5)
        for p in stuck:
            if p.process.exitcode is None:
                self.report.problems.append(f"{p.label} did not stop; killed (thread stacks on stderr)")
                p.process.kill()
                self._join_process(p, 5)
        self._pump(0.05, bar)  # reports the last exits left in the queues
        known = set(self.report.deaths)
        for p in started:
            if p.key in self.dead:
                continue
            d = self._dead_one(p)
            if d is not None and d not in known:
                self.report.deaths.append(d)
        self.local.close()

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
            entry = {
                "stage": p.stage,
                "replica": p.replica,
                "rank": p.rank,
                "leftover_requests": final["leftover_requests"],
                "kv_tracked": final["kv_tracked"],
                "health": final["health"],
            }
            if p.host is not None:
                entry["host"] = p.host
            self.report.stages.append(entry)
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
        self._check_backends()
        self.report.edges = [edge_summary(edges[name]) for name in order]
        self.report.replicas = [
            {"stage": sid, "replica": r, "alive": (sid, r) not in self.retired, **self.per_replica.get((sid, r), {"routed": 0, "completed": 0, "failed": 0})}
            for sid, r in sorted(self.inboxes)
            if self.plan.plan(sid).replicas > 1
        ]
        self.report.hosts = [{"host": self.directory.here, "stages": self.directory.local, "coordinator": True}] if self.coord else []
        self.report.hosts += [h.describe() for h in self.directory.hosts.values()]

    def _check_backends(self) -> None:
        """What the backends still hold of this run, then free it: this host's share here, every other host's there.

        Whatever was left (a stage killed, a run interrupted) is reported and then freed, so no run
        leaves segments or keys behind; only provably stale or this run's data is touched.
        """
        if self.coord is None:
            used = self.plan.connectors()
            self.report.leaks += backend_leaks(self.plan.config, used, self.run_tag)
            self.report.reclaimed = reclaim(self.plan.config, used, self.run_tag)
            return
        here = self.directory.here
        shares = census_plan(self.plan, self.directory.layout(), here)
        live = [h for h in self.directory.hosts.values() if h.lost is None]
        for host in live:
            host.link.send({"op": "collect", "run_tag": self.run_tag, "instances": sorted(shares.get(host.name, ()))})
        mine = shares.get(here, set())
        self.report.leaks += backend_leaks(self.plan.config, mine, self.run_tag)
        self.report.reclaimed = reclaim(self.plan.config, mine, self.run_tag)
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while any(h.collected is None and h.lost is None for h in live) and time.monotonic() < deadline:
            self._pump(0.1, self._bar)
        for host in self.directory.hosts.values():
            if host.collected is None:
                why = host.lost or f"no answer within {COLLECT_TIMEOUT_S:.0f} s"
                if shares.get(host.name):
                    self.report.problems.append(f"host {host.name}: its leak check of {sorted(shares[host.name])} did not run ({why})")
                continue
            self.report.leaks += [f"host {host.name}: {line}" for line in host.collected.get("leaks", [])]
            self.report.reclaimed += [f"host {host.name}: {line}" for line in host.collected.get("reclaimed", [])]


def prepare(path: str | Path, options: RunOptions, coordination: Coordination | None = None) -> Orchestrator:
    """Load and validate ``path``: the orchestrator that runs it (nothing started yet)."""
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.pipeline.checks import plan_for_run

    config = load_pipeline_config(path, platform=options.platform)
    plan = plan_for_run(config, filename=str(path))
    return Orchestrator(plan, options, coordination)


def run_pipeline(path: str | Path, options: RunOptions, coordination: Coordination | None = None) -> RunReport:
    """Load, validate and run ``path``; the report says whether everything arrived intact and nothing leaked."""
    orchestrator = prepare(path, options, coordination)
    try:
        return orchestrator.run()
    finally:
        orchestrator.close_metrics()
