"""The coordinating host's view of the other hosts: which stages each runs, their processes, their inboxes.

The orchestrator drives a stage process the same way wherever it runs: it
puts control messages in the stage replica's inbox and reads its reports.
For a stage on another host, the inbox is a :class:`RemoteInbox` (the message
crosses the control channel, the host puts it in the local queue) and the
process a :class:`RemoteProcess` (its pid, exit code and death come over the
channel; a host that is lost takes all its processes with it, and the reason
names the host).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_plugins.config.placement import host_local
from omni_plugins.pipeline.control import ControlLink
from omni_plugins.pipeline.spec import PipelinePlan

#: the exit code a process of a lost host is given (its reason is :attr:`RemoteProcess.lost`)
LOST = -1


class RemoteProcess:
    """A stage process on another host, as far as the coordinator knows."""

    def __init__(self, stage: int, replica: int, rank: int) -> None:
        self.key = (stage, replica, rank)
        self.host: RemoteHost | None = None  # known once its host joined
        self.pid: int | None = None
        self._exitcode: int | None = None
        self.lost: str | None = None
        self._ended = threading.Event()

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def exited(self, code: int) -> None:
        if self._exitcode is None:
            self._exitcode = code
        self._ended.set()

    def host_lost(self, reason: str) -> None:
        if self._exitcode is None:
            self.lost = reason
            self._exitcode = LOST
        self._ended.set()

    def kill(self) -> None:
        self._tell("kill")

    def dump_stacks(self) -> None:
        self._tell("stacks")

    def join(self, timeout: float) -> None:
        self._ended.wait(max(0.0, timeout))

    def _tell(self, op: str) -> None:
        if self.host is not None and self._exitcode is None:
            stage, replica, rank = self.key
            self.host.link.send({"op": op, "stage": stage, "replica": replica, "rank": rank})


class RemoteInbox:
    """The inbox of a stage replica on another host: each message crosses the control channel (dropped while no host runs it)."""

    def __init__(self, hosts: HostDirectory, stage: int, replica: int) -> None:
        self._hosts, self._stage, self._replica = hosts, stage, replica

    def put(self, msg: tuple[Any, ...]) -> None:
        host = self._hosts.host_of(self._stage)
        if host is not None:
            host.link.send({"op": "to", "stage": self._stage, "replica": self._replica, "msg": list(msg)})

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


@dataclass
class RemoteHost:
    """A host that joined: its link, its stages, what its leak check found."""

    name: str
    stages: list[int]
    link: ControlLink
    procs: list[RemoteProcess] = field(default_factory=list)
    lost: str | None = None
    collected: dict[str, Any] | None = None

    @property
    def address(self) -> str:
        return self.link.peer

    def describe(self) -> dict[str, Any]:
        return {"host": self.name, "address": self.address, "stages": self.stages, "lost": self.lost}


class HostDirectory:
    """Which host runs which stage, for the coordinator (``here`` is its own name)."""

    def __init__(self, here: str, local_stages: Iterable[int]) -> None:
        self.here = here
        self.local = sorted(set(local_stages))
        self.hosts: dict[str, RemoteHost] = {}

    def host_of(self, stage: int) -> RemoteHost | None:
        return next((h for h in self.hosts.values() if stage in h.stages), None)

    def name_of(self, stage: int) -> str | None:
        if stage in self.local:
            return self.here
        host = self.host_of(stage)
        return host.name if host is not None else None

    def layout(self) -> dict[str, list[int]]:
        """Every host known so far and its stages (this one first)."""
        return {self.here: self.local, **{h.name: h.stages for h in self.hosts.values()}}


def census_plan(plan: PipelinePlan, layout: Mapping[str, Iterable[int]], here: str) -> dict[str, set[str]]:
    """Which host checks (and reclaims) which connector instances after the run.

    A host-local instance (shared memory, a local directory: its plugin declares
    ``cross_host`` false) is checked on every host whose stages use it: each has its
    own. A shared one (a Redis server, a store) is checked once, by this host if its
    stages use it, else by the first host (in ``layout`` order) whose stages do.
    """
    uses: dict[str, set[str]] = {host: {c for sid in stages for c in plan.plan(sid).connectors()} for host, stages in layout.items()}
    order = [here, *[h for h in layout if h != here]]
    out: dict[str, set[str]] = {host: set() for host in layout}
    local: dict[str, bool | None] = {}
    for instance in sorted(plan.connectors()):
        name = plan.config.connectors[instance].name
        if name not in local:
            local[name] = host_local(name)
        users = [h for h in order if instance in uses.get(h, set())]
        for host in users if local[name] else users[:1]:
            out[host].add(instance)
    return out
