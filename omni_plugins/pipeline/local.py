"""The stage processes of one host: forked from the preloaded fork server, driven over local queues.

Used by the coordinating host (:mod:`omni_plugins.pipeline.launcher`) for the
stages it runs itself and by every joining host (:mod:`omni_plugins.pipeline.agent`).
Each stage replica's rank 0 reads an inbox; every rank reports on one results
queue. The owner reads it directly (:meth:`LocalStages.reports`): a process
puts its last report in the queue's pipe before it exits, so reading the queue
once more after seeing an exit always finds that report.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omni_plugins.forkserver import preloaded_context, start_shielded
from omni_plugins.pipeline.pipes import Inbox, Outbox, read_any
from omni_plugins.pipeline.spec import PipelinePlan
from omni_plugins.pipeline.stage import StageLaunch, stage_main
from omni_plugins.ports import LOOPBACK

logger = logging.getLogger(__name__)


def stage_context(connectors: Iterable[str] = ()) -> Any:
    """How stage processes start: ``forkserver`` with torch, the stage module and the ``connectors``' plugins' preload
    modules imported once (see :mod:`omni_plugins.forkserver`)."""
    from omni_plugins.services import preload_modules

    core = ["torch", "omni_plugins.pipeline.stage", "omni_plugins.runtime", "omni_plugins.wire"]
    return preloaded_context([*core, *preload_modules(connectors)])


def stage_label(stage: int, replica: int, rank: int, *, replicated: bool, tp: bool) -> str:
    """A stage process's name in metrics: ``1``, ``1.r0`` (a replica), ``1.rank1`` (a TP rank)."""
    return f"{stage}" + (f".r{replica}" if replicated else "") + (f".rank{rank}" if tp else "")


class LocalProcess:
    """A stage process on this host, as the orchestrator sees any stage process."""

    def __init__(self, process: Any) -> None:
        self.process = process

    @property
    def pid(self) -> int | None:
        return int(self.process.pid) if self.process.pid is not None else None

    @property
    def exitcode(self) -> int | None:
        code = self.process.exitcode
        return None if code is None else int(code)

    @property
    def lost(self) -> str | None:
        return None  # a local process cannot be cut off

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def dump_stacks(self) -> None:
        """Its thread stacks to stderr (the stage registered SIGUSR1 with faulthandler)."""
        with contextlib.suppress(OSError, TypeError):
            os.kill(self.process.pid, signal.SIGUSR1)


@dataclass(frozen=True)
class Spawned:
    stage: int
    replica: int
    rank: int
    process: LocalProcess
    replicated: bool


class LocalStages:
    """The stage processes of ``stage_ids`` on this host."""

    def __init__(self, plan: PipelinePlan, stage_ids: Iterable[int], *, log_level: int, metrics: bool = False) -> None:
        self.plan = plan
        self.stage_ids = sorted(set(stage_ids))
        self.log_level = log_level
        self.metrics = metrics
        used = {c for sid in self.stage_ids for c in plan.plan(sid).connectors()}
        self.ctx = stage_context(plan.config.connectors[c].name for c in used)
        #: the reports of each stage process (pipes, not ``multiprocessing.Queue``: see :mod:`.pipes`)
        self.results: list[Inbox] = []
        #: control messages to each stage replica's rank 0, and the reading ends its process takes along
        self.inboxes: dict[tuple[int, int], Outbox] = {}
        self._inbox_ends: dict[tuple[int, int], Inbox] = {}
        for sid in self.stage_ids:
            for r in range(plan.plan(sid).replicas):
                reader, writer = self.ctx.Pipe(duplex=False)
                self.inboxes[(sid, r)], self._inbox_ends[(sid, r)] = Outbox(writer), Inbox(reader)
        self.spawned: list[Spawned] = []
        #: the rendezvous store of each TP group, hosted here (see :func:`rendezvous_store`)
        self._stores: list[Any] = []
        self.closed = False

    def spawn(self) -> list[Spawned]:
        start_shielded(self.ctx)
        data = self.plan.config.model_dump(mode="python")
        for sid in self.stage_ids:
            sp = self.plan.plan(sid)
            tp = sp.stage.tp_size > 1
            for replica in range(sp.replicas):
                port = None
                if tp:
                    store = rendezvous_store()
                    self._stores.append(store)
                    port = int(store.port)
                for rank in range(sp.stage.tp_size):
                    label = stage_label(sid, replica, rank, replicated=sp.replicas > 1, tp=tp) if self.metrics else None
                    launch = StageLaunch(data, self.plan.filename, sid, rank, port, self.log_level, replica, metrics_label=label)
                    inbox = self._inbox_ends.pop((sid, replica)) if rank == 0 else None
                    reader, writer = self.ctx.Pipe(duplex=False)
                    self.results.append(Inbox(reader))
                    name = f"omni-stage{sid}" + (f"-x{replica}" if sp.replicas > 1 else "") + f"-r{rank}"
                    p = self.ctx.Process(target=stage_main, args=(launch, inbox, Outbox(writer)), name=name, daemon=True)
                    p.start()
                    # the stage holds its ends now; without our copies a dead stage reads as the pipe's end
                    writer.close()
                    if inbox is not None:
                        inbox.close()
                    self.spawned.append(Spawned(sid, replica, rank, LocalProcess(p), sp.replicas > 1))
        return self.spawned

    def reports(self, handle: Callable[[Any], None], timeout: float) -> None:
        """Handle the next report of a stage process (waiting up to ``timeout`` s), then every one already there."""
        if self.closed or not self.results:
            time.sleep(timeout)
            return
        for report in read_any(self.results, timeout):
            handle(report)

    def close(self) -> None:
        """Close the pipes (control messages still queued are sent first, for a bounded time)."""
        self.closed = True
        for outbox in self.inboxes.values():
            outbox.close()
        for inbox in [*self.results, *self._inbox_ends.values()]:
            inbox.close()
        self._stores.clear()  # the stores' servers stop with their last reference


def rendezvous_store() -> Any:
    """A TCP store for a TP group's ranks to meet in, served by this process on a loopback port the OS chose.

    Bound before any rank starts: a port picked free and bound later by the group's rank 0 could
    be taken meanwhile by another process, and the group would fail with EADDRINUSE. The ranks
    join it as clients (``StageLaunch.dist_port``).
    """
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(LOOPBACK, 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False)


def drain(events: Any, handle: Callable[[Any], None], timeout: float) -> None:
    """Handle the next item of ``events`` (a queue; waiting up to ``timeout`` s), then every one already there."""
    try:
        item = events.get(timeout=timeout) if timeout > 0 else events.get_nowait()
    except queue.Empty:
        return
    handle(item)
    while True:
        try:
            handle(events.get_nowait())
        except queue.Empty:
            return
