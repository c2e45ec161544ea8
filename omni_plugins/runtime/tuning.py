"""Knobs of the transfer runtime (defaults suit a model step of a few ms)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ArrivalMode = Literal["auto", "block", "poll"]


@dataclass(frozen=True)
class RuntimeTuning:
    """How the I/O threads wait and retry.

    Attributes:
        arrival: ``"block"`` spends the time between sweeps in the connector's
            blocking ``get`` on the most likely next key; ``"poll"`` sleeps;
            ``"auto"`` blocks when the connector has ``capabilities.blocking_get``.
        wait_any: in block mode, with a connector that has
            ``capabilities.wait_any``, wait on every pending key at once
            (default); False keeps parking on the one predicted key.
        poll_min_s / poll_max_s: sweep interval, doubling while sweeps find
            nothing, reset when one does (bounds the wait of an unpredicted arrival).
        max_send_retries: re-queues of a failed ``put`` before it is dropped.
        retry_backoff_s: first retry delay (doubles per attempt).
        join_timeout_s: bounded join of each thread at shutdown.
        drain_timeout_s: how long shutdown lets queued sends finish.
        abort_scan_limit: on abort, how many next keys of a request to clean
            from the connector (chunks put but never read).
        snapshot_payloads: copy lists and tensors of outgoing payloads so the
            send thread never races the runner that produced them.
        send_handoff_s: ``send_chunk`` waits up to this long for the send
            thread to take the chunk it enqueued, so a step's puts run between
            its ``send_chunk`` calls instead of after the last one (the model
            thread would otherwise keep the GIL until its step ends). Skipped
            while the connector's puts take longer than this on average (a
            slow backend: the runner does not wait for it). 0 turns it off.
        anticipate_s / anticipate_after_s: with a connector that has
            ``capabilities.poll_any``, once arrivals come in bursts at a steady
            interval (a model's step rhythm), the receive thread busy-polls from
            ``anticipate_s`` before the next burst is due until
            ``anticipate_after_s`` past it instead of sleeping, so the burst meets
            a warm core (see :mod:`omni_plugins.runtime.rhythm`). Costs that
            window's CPU once per interval; withheld while the polls keep being
            preempted (busy cores). ``anticipate_s=0`` turns it off.
        anticipate_max_duty: no polling while the window would be more than
            this fraction of the interval (fast rhythms: too much CPU).
    """

    arrival: ArrivalMode = "auto"
    wait_any: bool = True
    poll_min_s: float = 0.0005
    poll_max_s: float = 0.005
    max_send_retries: int = 3
    retry_backoff_s: float = 0.002
    join_timeout_s: float = 5.0
    drain_timeout_s: float = 2.0
    abort_scan_limit: int = 256
    snapshot_payloads: bool = True
    send_handoff_s: float = 0.0005
    anticipate_s: float = 0.001
    anticipate_after_s: float = 0.0015
    anticipate_max_duty: float = 0.2

    def __post_init__(self) -> None:
        if self.arrival not in ("auto", "block", "poll"):
            raise ValueError(f"arrival must be 'auto', 'block' or 'poll', got {self.arrival!r}")
        for name in ("poll_min_s", "poll_max_s", "join_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.poll_min_s > self.poll_max_s:
            raise ValueError("minimum waits must not exceed maximum waits")
        if self.send_handoff_s < 0:
            raise ValueError("send_handoff_s must be >= 0")
        if self.anticipate_s < 0 or self.anticipate_after_s < 0:
            raise ValueError("anticipate_s and anticipate_after_s must be >= 0")
        if not 0 < self.anticipate_max_duty <= 1:
            raise ValueError("anticipate_max_duty must be in (0, 1]")
        if self.max_send_retries < 0:
            raise ValueError("max_send_retries must be >= 0")

    @classmethod
    def fixed_poll(cls, interval_s: float = 0.005) -> RuntimeTuning:
        """The reference's behaviour: poll every ``interval_s`` regardless of the connector."""
        return cls(arrival="poll", poll_min_s=interval_s, poll_max_s=interval_s)
