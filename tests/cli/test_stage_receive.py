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
        return SimpleNamespace(chunk_ready={"r0"}, chunk_finished=finished, failed=set(), timed_out=set())

    def get_local_stage_payload(self, rid: str) -> Any:
        return self.cache.get(rid)

    def pop_local_stage_payload(self, rid: str) -> Any:
        return self.cache.pop(rid, None)


class RecordingCheck:
    """Stands in for ``InputCheck``: records the steps of every payload it is shown."""

    def __init__(self) -> None:
        self.shown: list[list[int]] = []

    def check(self, rid: str, payload: Any, seen: int) -> int:
        self.shown.append(list(payload["step"]))
        return len(payload["step"])


def _runner(rt: LateLastChunkRuntime) -> StageRunner:
    runner = object.__new__(StageRunner)  # only what _receive reads; no process, no connector
    runner.up = SimpleNamespace()
    runner.input = RecordingCheck()  # type: ignore[assignment]
    runner.leader = True
    runner.rank = 0
    runner.me = SimpleNamespace(stage_id=1, stage=SimpleNamespace(async_chunk=True, worker_type="ar"))  # type: ignore[assignment]
    runner.rt = rt  # type: ignore[assignment]
    runner.requests = {"r0": _Req(SynthRequest("r0", "r0"))}
    return runner


@pytest.mark.parametrize("lands_late", [True, False])
def test_a_finished_stream_is_checked_with_every_step(lands_late: bool) -> None:
    rt = LateLastChunkRuntime(lands_late=lands_late)
    runner = _runner(rt)
    assert runner._receive()
    req = runner.requests["r0"]
    if lands_late:
        assert runner.input.shown[-1] == [0, 1, 2, 3]  # type: ignore[attr-defined]
        assert req.input_finished and req.seen == 4
    else:
        assert runner.input.shown == [[0, 1, 2]]  # type: ignore[attr-defined]
        assert not req.input_finished and req.seen == 3
