"""``omni-plugins run``'s stage loop reads a finished stream from the runtime's cache.

The race, pinned here deterministically: a stream's last chunk lands between the stage's
``recv_chunk()`` and its ``collect_signals()``. The signals then say the stream
finished while the ``recv_chunk()`` result still lacks that chunk; a stage that
took the payload from that result would check an incomplete input and wait
forever for a step that had already arrived. Unit level: a scripted runtime
injects the late chunk at exactly that point.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omni_plugins.pipeline.stage import StageRunner, SynthRequest, _Req


class LateLastChunkRuntime:
    """``recv_chunk`` returns steps 0..2; step 3 (the last) lands before ``collect_signals``."""

    def __init__(self, *, lands_late: bool) -> None:
        self.cache: dict[str, dict[str, list[int]]] = {"r0": {"step": [0, 1, 2]}}
        self.lands_late = lands_late

    def recv_chunk(self) -> dict[str, Any]:
        out = {rid: dict(p) for rid, p in self.cache.items()}
        if self.lands_late:
            self.cache["r0"] = {"step": [0, 1, 2, 3]}
        return out

    def collect_signals(self) -> SimpleNamespace:
        finished = {"r0"} if self.cache["r0"]["step"][-1] == 3 else set()
        return SimpleNamespace(chunk_ready={"r0"}, chunk_finished=finished, failed=set(), timed_out=set(), missing_sources={})

    def get_local_stage_payload(self, rid: str) -> Any:
        return self.cache.get(rid)

    def pop_local_stage_payload(self, rid: str) -> Any:
        return self.cache.pop(rid, None)


class LateFanInRuntime:
    """Fan-in (sources 0 and 1): ``recv_chunk`` returns source 0's steps; source 1's last chunk lands before ``collect_signals``."""

    fan_in = True

    def __init__(self) -> None:
        self.cache: dict[str, dict[int, dict[str, list[int]]]] = {"r0": {0: {"step": [0, 1]}, 1: {"step": [0]}}}

    def recv_chunk(self) -> dict[str, Any]:
        out = {"r0": {0: dict(self.cache["r0"][0])}}  # source 0 woke it
        self.cache["r0"][1] = {"step": [0, 1]}  # source 1's last chunk lands now
        return out

    def collect_signals(self) -> SimpleNamespace:
        return SimpleNamespace(
            chunk_ready={"r0"},
            chunk_ready_sources={"r0": {0, 1}},
            chunk_finished=set(),
            chunk_finished_sources={"r0": {1}},
            failed=set(),
            timed_out=set(),
            missing_sources={},
        )

    def get_local_stage_payload(self, rid: str) -> Any:
        return self.cache.get(rid)


class RecordingCheck:
    """Stands in for ``InputCheck``: records the steps of every payload it is shown."""

    def __init__(self) -> None:
        self.shown: list[list[int]] = []

    def check(self, rid: str, payload: Any, seen: int) -> int:
        self.shown.append(list(payload["step"]))
        return len(payload["step"])


def _runner(rt: Any, sources: tuple[int, ...] = (0,)) -> StageRunner:
    runner = object.__new__(StageRunner)  # only what _receive reads; no process, no connector
    runner.ups = {src: SimpleNamespace() for src in sources}  # type: ignore[misc]
    runner.inputs = {(src, 0): RecordingCheck() for src in sources}  # type: ignore[misc]
    runner.leader = True
    runner.rank = 0
    runner.replica = 0
    runner.me = SimpleNamespace(stage_id=2, replicas=1, stage=SimpleNamespace(async_chunk=True, worker_type="ar"))  # type: ignore[assignment]
    if not hasattr(rt, "fan_in"):
        rt.fan_in = False
    runner.rt = rt
    req = _Req(SynthRequest("r0", "r0"))
    req.seen = dict.fromkeys(sources, 0)
    runner.requests = {"r0": req}
    return runner


@pytest.mark.parametrize("lands_late", [True, False])
def test_a_finished_stream_is_checked_with_every_step(lands_late: bool) -> None:
    rt = LateLastChunkRuntime(lands_late=lands_late)
    runner = _runner(rt)
    assert runner._receive()
    req = runner.requests["r0"]
    shown = runner.inputs[(0, 0)].shown  # type: ignore[attr-defined]
    if lands_late:
        assert shown[-1] == [0, 1, 2, 3]
        assert req.finished_sources == {0} and req.seen[0] == 4
    else:
        assert shown == [[0, 1, 2]]
        assert not req.finished_sources and req.seen[0] == 3


def test_a_fan_in_source_that_lands_between_the_calls_is_read_from_the_cache() -> None:
    runner = _runner(LateFanInRuntime(), sources=(0, 1))
    assert runner._receive()
    req = runner.requests["r0"]
    assert runner.inputs[(0, 0)].shown == [[0, 1]]  # type: ignore[attr-defined]
    assert runner.inputs[(1, 0)].shown == [[0, 1]]  # type: ignore[attr-defined]  # its last chunk, from the cache
    assert req.seen == {0: 2, 1: 2} and req.finished_sources == {1}
