"""A host that joins a pipeline run: ``omni-plugins run PIPELINE.yaml --stages 1,2 --join ADDR`` (or ``--host NAME``).

It connects to the coordinating host's control channel
(:mod:`omni_plugins.pipeline.control`), authenticates, says which stages it
runs, starts them (:class:`~omni_plugins.pipeline.local.LocalStages`) and then
only relays: the coordinator's control messages into the stages' inboxes, the
stages' reports and exits back. Payloads never pass through it. When the
stages stopped it checks and reclaims the backends the coordinator gives it
(its host-local ones, and any shared one no other host checks), reports what
it found, prints the run's report and exits with its status.

If the coordinator is lost, it stops its stages itself (the same ``stop``
they would have got), checks and reclaims every backend its stages used, and
exits with status 1.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_plugins.pipeline.control import HOST_TIMEOUT_S, VERSION, ControlError, ControlLink, connect, pipeline_digest
from omni_plugins.pipeline.leaks import backend_leaks, reclaim
from omni_plugins.pipeline.local import LocalProcess, LocalStages, drain

logger = logging.getLogger(__name__)

#: how long stopped stages may take to exit before they are killed
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JoinOptions:
    host: str
    stages: tuple[int, ...]
    join: str
    secret: bytes = field(repr=False)
    start_timeout_s: float = 120.0
    host_timeout_s: float = HOST_TIMEOUT_S
    log_level: int = logging.WARNING
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    #: a vLLM-Omni file's platforms section to apply
    platform: str | None = None


@dataclass
class HostOutcome:
    """How the run ended, seen from this host."""

    ok: bool
    table: str = ""
    problems: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    reclaimed: list[str] = field(default_factory=list)
    metrics: str | None = None


class HostAgent:
    def __init__(self, path: str | Path, options: JoinOptions) -> None:
        from omni_plugins.config import load_pipeline_config
        from omni_plugins.pipeline.checks import plan_for_run

        self.path = str(path)
        self.opts = options
        self.plan = plan_for_run(load_pipeline_config(path, platform=options.platform), filename=self.path)
        self.local = LocalStages(self.plan, options.stages, log_level=options.log_level, metrics=options.metrics_port is not None)
        self.events: queue.Queue[Any] = queue.Queue()
        self.procs: dict[tuple[int, int, int], LocalProcess] = {}
        self.labels: dict[tuple[int, int, int], str] = {}
        self.reported: set[tuple[int, int, int]] = set()
        self.host_metrics: Any = None
        self.run_tag = ""
        self.link: ControlLink | None = None

    # ------------------------------------------------------------------ run
    def run(self) -> HostOutcome:
        link = self.link = self._join()
        try:
            if self.opts.metrics_port is not None:
                from omni_plugins.pipeline.hostmetrics import HostMetrics

                self.host_metrics = HostMetrics()
                port = self.host_metrics.serve(self.opts.metrics_port, self.opts.metrics_host)
                print(f"omni-plugins: stage metrics on http://{self.opts.metrics_host}:{port}/metrics", file=sys.stderr)
            for spawned in self.local.spawn():
                key = (spawned.stage, spawned.replica, spawned.rank)
                self.procs[key] = spawned.process
            link.send({"op": "spawned", "procs": [[*key, p.pid] for key, p in self.procs.items()]})
            link.start(self.events.put, lambda why: self.events.put(("lost", why)), name="omni-control")
            try:
                return self._relay(link)
            except KeyboardInterrupt:  # Ctrl-C here: stop this host's stages as if the coordinator were gone, then exit 130
                outcome = self._on_our_own("interrupted")
                for line in [*outcome.problems[1:], *outcome.leaks, *outcome.reclaimed]:
                    print(f"  host {self.opts.host}: {line}", file=sys.stderr)
                raise
        finally:
            self._stop_local()
            link.close("done")

    def _join(self) -> ControlLink:
        opts = self.opts
        print(f"omni-plugins: host {opts.host} joining {opts.join} with stage(s) {', '.join(map(str, opts.stages))}", file=sys.stderr)
        link = connect(opts.join, opts.secret, wait_s=opts.start_timeout_s, timeout_s=opts.host_timeout_s)
        hello = {"op": "join", "host": opts.host, "stages": list(opts.stages), "pipeline": pipeline_digest(self.path), "version": VERSION}
        if not link.send(hello):
            raise ControlError(f"the coordinating host at {opts.join} hung up: {link.lost}")
        reply = link.receive(opts.start_timeout_s)
        if reply.get("op") == "refused":
            link.close("refused")
            raise ControlError(f"the coordinating host at {opts.join} refused host {opts.host!r}: {reply.get('error')}")
        if reply.get("op") != "welcome" or not isinstance(reply.get("run_tag"), str):
            link.close("protocol")
            raise ControlError(f"the coordinating host at {opts.join} answered {reply.get('op')!r} to the join")
        self.run_tag = reply["run_tag"]
        return link

    def _relay(self, link: ControlLink) -> HostOutcome:
        """Until the coordinator says bye (or is lost): pass messages both ways, report exits, check backends on request."""
        outcome: HostOutcome | None = None

        def handle(event: Any) -> None:
            nonlocal outcome
            if outcome is not None:
                return  # the run ended (bye): the link closing after it is no news
            lost = isinstance(event, tuple)  # ("lost", why), else a message from the coordinator
            outcome = self._coordinator_lost(str(event[1])) if lost else self._command(event) or outcome

        while outcome is None:
            drain(self.events, handle, 0)
            self.local.reports(self._forward, 0.05)
            self._report_exits()
        return outcome

    def _forward(self, report: dict[str, Any]) -> None:
        """A local stage's report, to the coordinator as it is."""
        self._note_metrics(report)
        if self.link is not None:
            self.link.send({"op": "stage", "msg": report})

    def _command(self, msg: dict[str, Any]) -> HostOutcome | None:
        op = msg.get("op")
        if op == "to":
            inbox = self.local.inboxes.get((int(msg["stage"]), int(msg["replica"])))
            if inbox is not None:
                inbox.put(tuple(msg["msg"]))
        elif op in ("kill", "stacks"):
            proc = self.procs.get((int(msg["stage"]), int(msg["replica"]), int(msg["rank"])))
            if proc is not None:
                proc.dump_stacks() if op == "stacks" else proc.kill()
        elif op == "collect":
            self._wait_exits(STOP_TIMEOUT_S)
            instances = [str(i) for i in msg.get("instances", [])]
            leaks = backend_leaks(self.plan.config, instances, self.run_tag)
            reclaimed = reclaim(self.plan.config, instances, self.run_tag)
            assert self.link is not None
            self.link.send({"op": "collected", "leaks": leaks, "reclaimed": reclaimed})
        elif op == "bye":
            return HostOutcome(ok=bool(msg.get("ok")), table=str(msg.get("table", "")))
        return None

    def _coordinator_lost(self, why: str) -> HostOutcome:
        """Nobody drives the run any more: stop the stages, free what they used, fail."""
        logger.warning("the coordinating host at %s is lost (%s): stopping this host's stages", self.opts.join, why)
        return self._on_our_own(f"the coordinating host at {self.opts.join} was lost: {why}")

    def _on_our_own(self, why: str) -> HostOutcome:
        """Stop this host's stages (the ``stop`` the coordinator would send), then check and free every backend they used."""
        for inbox in self.local.inboxes.values():
            inbox.put(("stop",))
        problems = [why]
        problems += self._wait_exits(STOP_TIMEOUT_S)
        used = {c for sid in self.opts.stages for c in self.plan.plan(sid).connectors()}
        outcome = HostOutcome(ok=False, problems=problems)
        if self.run_tag:
            outcome.leaks = backend_leaks(self.plan.config, used, self.run_tag)
            outcome.reclaimed = reclaim(self.plan.config, used, self.run_tag)
        return outcome

    # ------------------------------------------------------------------ processes
    def _report_exits(self) -> None:
        """Tell the coordinator about processes that exited, after their last reports (already in the queue's pipe)."""
        ended = [key for key, proc in self.procs.items() if proc.exitcode is not None and key not in self.reported]
        if not ended or self.link is None:
            return
        self.local.reports(self._forward, 0)
        for key in ended:
            self.reported.add(key)
            self.link.send({"op": "exited", "stage": key[0], "replica": key[1], "rank": key[2], "code": self.procs[key].exitcode})

    def _wait_exits(self, timeout: float) -> list[str]:
        """Wait (handling reports) until every local stage process exited; kill what did not, and say so."""
        deadline = time.monotonic() + timeout
        while any(p.exitcode is None for p in self.procs.values()) and time.monotonic() < deadline:
            self.local.reports(self._forward, 0.05)
        problems = []
        for key, proc in self.procs.items():
            if proc.exitcode is None:
                proc.dump_stacks()
                time.sleep(0.5)
                proc.kill()
                proc.join(5)
                problems.append(f"stage {key[0]} replica {key[1]} rank {key[2]} on host {self.opts.host} did not stop; killed")
        self._report_exits()
        return problems

    def _stop_local(self) -> None:
        """However the run ended, no stage process of this host outlives it."""
        for key, proc in self.procs.items():
            if proc.exitcode is None:
                logger.warning("stage %s replica %s rank %s still running at exit: killed", *key)
                proc.kill()
                proc.join(5)
        self.local.close()

    def _note_metrics(self, msg: dict[str, Any]) -> None:
        if self.host_metrics is None:
            return
        from omni_plugins.pipeline.local import stage_label

        stage, replica, rank = int(msg.get("stage", -1)), int(msg.get("replica", 0)), int(msg.get("rank", 0))
        if stage not in self.opts.stages:
            return
        sp = self.plan.plan(stage)
        self.host_metrics.note(msg, stage_label(stage, replica, rank, replicated=sp.replicas > 1, tp=sp.stage.tp_size > 1))

    def close_metrics(self) -> None:
        if self.host_metrics is not None:
            self.host_metrics.close()
