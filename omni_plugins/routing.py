"""Picking one replica of a replicated stage for each request (``replicas: N``, ``routing: POLICY``).

Whoever admits requests (``omni-plugins run``'s orchestrator, or a serving
front end) keeps one :class:`ReplicaRouter` per replicated stage and asks it
where each new request goes; every edge into that stage then carries the
request to that replica only (see :mod:`omni_plugins.config.topology`: keys
are per request, so only the chosen replica looks for them).

Policies:

* ``round_robin`` (the default): replicas in turn, skipping retired ones;
* ``least_inflight``: the replica with the fewest requests routed to it and
  not yet done, the lowest index on a tie.
"""

from __future__ import annotations

from omni_plugins.config.models import DEFAULT_ROUTING, RoutingPolicy


class NoReplicaError(RuntimeError):
    """Every replica of the stage was retired."""


class ReplicaRouter:
    """Routes requests over the replicas of one stage and counts what each holds."""

    def __init__(self, replicas: int, policy: RoutingPolicy = DEFAULT_ROUTING) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if policy not in ("round_robin", "least_inflight"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.inflight = [0] * replicas
        self.routed = [0] * replicas
        self.live = set(range(replicas))
        self._next = 0

    def pick(self) -> int:
        """The replica for a new request (counted in flight until :meth:`done`)."""
        if not self.live:
            raise NoReplicaError("every replica of the stage was retired")
        n = len(self.inflight)
        if self.policy == "least_inflight":
            choice = min(sorted(self.live), key=lambda r: self.inflight[r])
        else:
            choice = next(r % n for r in range(self._next, self._next + n) if r % n in self.live)
            self._next = choice + 1
        self.inflight[choice] += 1
        self.routed[choice] += 1
        return choice

    def done(self, replica: int) -> None:
        """A request routed to ``replica`` left it (completed, failed or aborted)."""
        if self.inflight[replica] > 0:
            self.inflight[replica] -= 1

    def retire(self, replica: int) -> None:
        """No more requests go to ``replica`` (it died)."""
        self.live.discard(replica)
