"""When the next burst of arrivals is due: the receive thread polls right before it instead of sleeping.

Streaming stages send at their model's step rhythm, so the receive thread
sees bursts of arrivals (a step's chunks) at a steady interval with silence
in between. Sleeping through that silence costs more than the sleep: on a
virtual machine an idle vCPU halts, the host runs something else on the core,
and the first chunk of every burst then meets a cold thread -- the wake-up and
the code after it (connector, decode, delivery) run several times slower, and
the rest of the burst queues behind it. A thread that busy-polls from shortly
before the burst is due keeps its core and caches warm.

:class:`ArrivalRhythm` learns the interval from the starts of past bursts (an
arrival after at least ``burst_gap_s`` of silence starts one) and says when to
poll: from ``lead_s`` before the next expected start to ``after_s`` past it.
It says nothing until three bursts in a row were evenly spaced (each interval
within a quarter of the running mean), while polling would take more than
``max_duty`` of the interval, or once the bursts stopped (three intervals with
no arrival): polling is then either pointless or too expensive.

Polling needs a core nobody else wants. On a machine whose cores are busy (another
job, more runnable threads than cores) the spinning thread is preempted and takes
its core from threads that have real work (with one CPU-bound neighbour on two
cores, most polls are preempted; on idle cores almost none are).
:meth:`ArrivalRhythm.polled` is told after each poll whether
the thread was preempted meanwhile (the receiver reads its involuntary context
switches); while that happened in most recent polls, windows are withheld except
one every ``_PROBE_INTERVALS`` intervals, which re-measures.
"""

from __future__ import annotations

#: a burst's interval must be within this fraction of the running mean to count as steady
_STEADY = 0.25
#: steady intervals in a row before polling starts
_STEADY_RUN = 2
#: weight of the newest interval in the running mean
_WEIGHT = 0.2
#: no arrival for this many intervals: the rhythm is over (until it is learnt again)
_SILENT_INTERVALS = 3
#: weight of the newest poll in the running share of polls that were preempted
_PREEMPTED_WEIGHT = 0.25
#: above this share of preempted polls the cores are taken: windows are withheld
_CONTENDED = 0.5
#: while withheld, one window every this many intervals still polls (to notice the cores are free again)
_PROBE_INTERVALS = 8


class ArrivalRhythm:
    """The interval between bursts of arrivals, and when to poll for the next one (one receive thread)."""

    __slots__ = ("after_s", "burst_gap_s", "interval", "last", "last_probe", "lead_s", "max_duty", "preempted", "start", "steady")

    def __init__(self, *, lead_s: float, after_s: float, burst_gap_s: float, max_duty: float) -> None:
        self.lead_s = lead_s
        self.after_s = after_s
        self.burst_gap_s = burst_gap_s
        self.max_duty = max_duty
        self.start: float | None = None  # when the latest burst started
        self.last = float("-inf")  # the latest arrival
        self.interval: float | None = None  # running mean between burst starts
        self.steady = 0  # steady intervals in a row
        self.preempted = 0.0  # running share of polls during which the thread was preempted
        self.last_probe = float("-inf")  # when a withheld rhythm last polled anyway

    def arrived(self, now: float) -> None:
        """Something arrived at ``now`` (monotonic seconds, non-decreasing)."""
        if now - self.last >= self.burst_gap_s:
            if self.start is not None:
                gap = now - self.start
                mean = self.interval
                if mean is not None and abs(gap - mean) <= _STEADY * mean:
                    self.interval = mean + _WEIGHT * (gap - mean)
                    self.steady += 1
                else:
                    self.interval, self.steady = gap, 0
            self.start = now
        self.last = now

    def polled(self, preempted: bool, now: float) -> None:
        """A poll ended at ``now``; ``preempted``: the polling thread lost its core to another meanwhile."""
        self.preempted += _PREEMPTED_WEIGHT * (preempted - self.preempted)
        if self.contended:
            self.last_probe = now

    @property
    def contended(self) -> bool:
        """Most recent polls were preempted: the cores are busy, polling would take one from real work."""
        return self.preempted > _CONTENDED

    def window(self, now: float) -> tuple[float, float] | None:
        """``(poll_from, poll_until)`` around the next expected burst start, or None (do not poll)."""
        start, interval = self.start, self.interval
        if start is None or interval is None or self.steady < _STEADY_RUN:
            return None
        if self.lead_s + self.after_s > self.max_duty * interval or now - self.last > _SILENT_INTERVALS * interval:
            return None
        if self.contended and now - self.last_probe < _PROBE_INTERVALS * interval:
            return None
        due = start + interval
        if now > due + self.after_s:  # that one is late or skipped: the one after it
            due += interval * (1 + int((now - due - self.after_s) // interval))
        return due - self.lead_s, due + self.after_s
