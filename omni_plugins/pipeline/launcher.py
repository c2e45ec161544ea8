"""The orchestrator of ``omni-plugins run``: spawn stage processes, feed requests, collect, check, report.

The orchestrator never touches payloads. It sends request ids to stage 0's
control queue (at most ``concurrency`` in flight), counts completions the last
stage reports on the results queue, then stops every stage, checks for leaks
and builds a :class:`RunReport`. Every wait is bounded; a stage process that
dies is reported with its stage id and exit reason and the others are stopped.
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
    rank: int
    process: Any
    ready: bool = False
    final: dict[str, Any] | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"stage {self.stage} rank {self.rank}"


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
        self.inboxes: dict[int, Any] = {s.stage_id: self.ctx.Queue() for s in plan.stages}
        self.procs: list[_Proc] = []
        self.report = RunReport(pipeline=plan.filename, requests=options.requests, concurrency=options.concurrency)
        self.in_flight: set[str] = set()
        self.done: set[str] = set()
        self.progress: dict[str, set[tuple[int, int]]] = {}  # request -> stage ranks done with it
        self.run_tag = uuid.uuid4().hex[:6]
        prefix = run_id_prefix(self.run_tag)
        self.ids = [f"{prefix}{i:05d}" for i in range(options.requests)]
        self.interrupts = _Interrupts()

    # ------------------------------------------------------------------ processes
    def spawn(self) -> None:
        start_shielded(self.ctx)
        data = self.plan.config.model_dump(mode="python")
        for sp in self.plan.stages:
            port = free_port() if sp.stage.tp_size > 1 else None
            for rank in range(sp.stage.tp_size):
                launch = StageLaunch(data, self.plan.filename, sp.stage_id, rank, port, self.opts.log_level)
                inbox = self.inboxes[sp.stage_id] if rank == 0 else None
                down = self.inboxes[sp.downstream] if rank == 0 and sp.downstream is not None else None
                p = self.ctx.Process(
                    target=stage_main, args=(launch, inbox, down, self.results), name=f"omni-stage{sp.stage_id}-r{rank}", daemon=True
                )
                p.start()
                self.procs.append(_Proc(sp.stage_id, rank, p))

    def _proc(self, stage: int, rank: int) -> _Proc | None:
        return next((p for p in self.procs if p.stage == stage and p.rank == rank), None)

    def _handle(self, msg: dict[str, Any], bar: Any) -> None:
        kind = msg.get("kind")
        proc = self._proc(int(msg.get("stage", -1)), int(msg.get("rank", -1)))
        if kind == "ready" and proc:
            proc.ready = True
        elif kind == "finished":
            self._finished(str(msg["rid"]), msg.get("reason"), proc, bar)
        elif kind == "error" and proc:
            proc.error = str(msg.get("error"))
            logger.debug("%s traceback:\n%s", proc.label, msg.get("traceback"))
        elif kind == "final" and proc:
            proc.final = msg

    def _finished(self, rid: str, reason: Any, proc: _Proc | None, bar: Any) -> None:
        """One stage rank is done with ``rid``; the request completes when every stage rank is."""
        if rid not in self.in_flight:
            self.report.problems.append(f"{proc.label if proc else '?'}: report about unknown or finished request {rid}")
            return
        if reason and rid not in self.report.failed:
            self.report.failed[rid] = str(reason)
            for q in self.inboxes.values():  # the other stages drop it now instead of waiting for input that never comes
                q.put(("abort", rid))
        ranks = self.progress.setdefault(rid, set())
        ranks.add((proc.stage, proc.rank) if proc else (-1, -1))
        if len(ranks) < len(self.procs):
            return
        del self.progress[rid]
        self.in_flight.discard(rid)
        self.done.add(rid)
        if rid not in self.report.failed:
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
            why = exit_reason(code)
            if p.error:
                why += f" ({p.error})"
            out.append(f"{p.label} (pid {p.process.pid}) died: {why}")
        return out

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
                return False
            if time.monotonic() > deadline:
                slow = [p.label for p in self.procs if not p.ready]
                self.report.problems.append(f"stages not ready after {self.opts.start_timeout_s:.0f}s: {', '.join(slow)}")
                return False
            self._pump(0.1, bar)
        return True

    def _feed(self, bar: Any, started: float) -> None:
        pending = list(reversed(self.ids))
        first = self.inboxes[self.plan.first.stage_id]
        last_progress = time.monotonic()
        while (pending or self.in_flight) and not self.interrupts.count:
            while pending and len(self.in_flight) < self.opts.concurrency:
                rid = pending.pop()
                self.in_flight.add(rid)
                first.put(("admit", rid))
            before = len(self.done)
            self._pump(0.05, bar)
            now = time.monotonic()
            if len(self.done) != before:
                last_progress = now
            dead = self._dead()
            if dead:
                self.report.deaths += dead
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
        for d in self._dead(expected=True):
            if d not in known:
                self.report.deaths.append(d)
        for q in [*self.inboxes.values(), self.results]:
            q.close()
            q.join_thread()

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
            self.report.leaks += health_leaks(where, final["health"])
            for i, raw in enumerate(final["stats"]):
                if i == 1 and not final["kv"]:
                    continue
                st = EdgeStats.from_json(raw)
                if i == 0 and p.rank != 0:
                    # payloads are moved by rank 0; a follower checks the broadcast copy: count only what it found wrong
                    st = EdgeStats(st.edge, mismatches=st.mismatches, errors=[f"rank {p.rank}: {e}" for e in st.errors])
                if st.edge not in edges:
                    edges[st.edge] = EdgeStats(st.edge)
                    order.append(st.edge)
                edges[st.edge].merge(st)
        used = {s.connector for s in self.plan.stages if s.connector}
        self.report.leaks += backend_leaks(self.plan.config, used, self.run_tag)  # type: ignore[arg-type]
        # whatever was left (a stage killed, a run interrupted) is reported above and then freed here,
        # so no run leaves segments or keys behind; only provably stale or this run's data is touched
        self.report.reclaimed = reclaim(self.plan.config, used, self.run_tag)  # type: ignore[arg-type]
        self.report.edges = [edge_summary(edges[name]) for name in order]


def run_pipeline(path: str | Path, options: RunOptions) -> RunReport:
    """Load, validate and run ``path``; the report says whether everything arrived intact and nothing leaked."""
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.pipeline.checks import plan_for_run

    config = load_pipeline_config(path)
    plan = plan_for_run(config, filename=str(path))
    return Orchestrator(plan, options).run()
