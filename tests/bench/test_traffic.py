"""The traffic of the runtime sections: which streams emit in each step, and which request a chunk belongs to."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from omni_plugins.bench.scaling import PER_STEP, STEP_S, traffic_for
from omni_plugins.bench.traffic import StageProcesses, Traffic


def test_every_stream_emits_in_every_step_by_default() -> None:
    t = Traffic(4, 4096, 0.01, 8, 4)
    assert [list(t.emitters(s)) for s in range(2)] == [[0, 1, 2, 3]] * 2
    assert (t.chunks, t.chunks_per_stream, t.offered_gbps) == (32, 8, 4 * 4096 / 0.01 / 1e9)


def test_a_window_of_streams_rotates_through_all_of_them() -> None:
    t = Traffic(6, 4096, 0.01, 9, 3, per_step=4)
    emitted = Counter(i for s in range(t.steps) for i in t.emitters(s))
    assert all(len(set(t.emitters(s))) == 4 for s in range(t.steps))
    assert emitted == dict.fromkeys(range(6), 6)  # each stream equally often: two whole requests each
    assert t.chunks_per_stream == 6 and t.label() == "4 of 6 x 4KiB / 10 ms"
    assert [t.request_id("x", 5, c) for c in (0, 2, 3)] == ["x-5-0", "x-5-0", "x-5-1"]


def test_steps_that_would_leave_a_request_unfinished_are_refused() -> None:
    with pytest.raises(ValueError, match="do not end"):
        Traffic(6, 4096, 0.01, 10, 3, per_step=4)


@pytest.mark.parametrize("streams", [16, 64, 256, 1024])
def test_scaling_holds_the_steps_constant_as_streams_grow(streams: int) -> None:
    t = traffic_for(streams, 1.5, 4)
    assert (t.interval_s, t.emitting) == (STEP_S, PER_STEP)
    assert t.chunks_per_stream % 4 == 0 and t.chunks_per_stream >= 4


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to")
def test_pinned_stage_processes_run_on_a_cpu_each() -> None:
    procs = StageProcesses(2, pinned=True)
    try:
        assert procs.pinned
        placed = [os.sched_getaffinity(p.pid) for p in procs._procs if p.pid is not None]
        assert len(placed) == 2 and all(len(cpus) == 1 for cpus in placed) and placed[0] != placed[1]
    finally:
        procs.close()
