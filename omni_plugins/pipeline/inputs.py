"""Checking what a stage receives against what its upstream stage must have sent.

Three delivery shapes, by the receiving stage's mode:

* full payload (``async_chunk: false``): every step at once;
* streaming, ``ar`` worker: the runtime merges chunks, so the payload holds
  every step so far -- only the rows added since the last look are checked;
* streaming, ``generation`` worker: one chunk (one step) at a time.

``trace.step`` in the payload says which steps are there; values, dtype and
shape of every tensor are recomputed with :mod:`omni_plugins.pipeline.checksums`
(from the source stage, the request and the step: checked per edge and source).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from omni_plugins.metrics import NO_OBSERVER, EdgeObserver
from omni_plugins.pipeline.checksums import step_output, verify
from omni_plugins.pipeline.spec import StagePlan
from omni_plugins.pipeline.stats import EdgeStats


class InputCheck:
    """The receive side of one edge, for one stage rank: what ``upstream`` sends ``to_stage``."""

    def __init__(self, upstream: StagePlan, *, to_stage: int, merged: bool, stats: EdgeStats, observer: EdgeObserver = NO_OBSERVER) -> None:
        self.up = upstream
        self.merged = merged
        self.stats = stats
        #: the edge's metrics: each hand-off latency measured here (from the producer's trace stamps) goes there too
        self.observer = observer
        self.outputs = upstream.outputs_to(to_stage)
        #: outputs of the upstream stage that go elsewhere: this edge must not carry them
        self.elsewhere = [o.name for o in upstream.synthetic.outputs if o not in self.outputs]

    @property
    def total_steps(self) -> int:
        return self.up.synthetic.steps

    def _field(self, payload: Any, name: str) -> Any:
        section, _, field = name.partition(".")
        sec = payload.get(section) if isinstance(payload, dict) else None
        return sec.get(field) if isinstance(sec, dict) else None

    def _steps(self, payload: Any, rid: str) -> list[int] | None:
        steps = self._field(payload, "trace.step")
        if not isinstance(steps, torch.Tensor) or steps.dtype != torch.int64 or steps.ndim != 2:
            self.stats.mismatch(f"{rid}: payload has no valid trace.step tensor")
            return None
        return [int(v) for v in steps[:, 0].tolist()]

    def check(self, rid: str, payload: Any, seen: int) -> int:
        """Verify the steps of ``payload`` past ``seen``; return the new count of steps seen (``seen`` on error)."""
        now = time.time()
        steps = self._steps(payload, rid)
        if steps is None:
            return seen
        if self.merged:
            rows = list(range(seen, len(steps)))
            new = steps[seen:]
        else:
            rows = list(range(len(steps)))
            new = steps
        if not new:
            return seen
        want = list(range(seen, seen + len(new)))
        if new != want:
            self.stats.mismatch(f"{rid}: expected steps {want[:4]}..., got {new[:4]}... (lost, duplicated or out of order)")
            return seen
        stray = [name for name in self.elsewhere if self._field(payload, name) is not None]
        if stray:
            self.stats.mismatch(f"{rid}: got {stray}, which stage {self.up.stage_id} sends to other stages only (outputs[].to)")
            return seen
        nbytes = 0
        for spec in self.outputs:
            got = self._field(payload, spec.name)
            per = spec.shape[0]
            first = rows[0] * per
            if isinstance(got, torch.Tensor) and got.ndim >= 1:
                got = got[first : first + per * len(new)]
            expected = torch.cat([step_output(self.up.synthetic.seed, rid, self.up.stage_id, spec, s) for s in new], dim=0)
            problem = verify(f"{rid} {spec.name} steps {new[0]}-{new[-1]}", got, expected)
            if problem:
                self.stats.mismatch(problem)
                return seen
            nbytes += spec.step_nbytes * len(new)
        stamps = self._field(payload, "trace.sent_at")
        sent: list[float] = []
        if isinstance(stamps, torch.Tensor) and stamps.ndim == 2:
            sent = [float(v) for v in stamps[rows[0] : rows[0] + len(new), 0].tolist()]
        if not self.merged and len(new) > 1:
            sent = sent[:1]  # one full payload: one hand-off
        self.stats.delivered(nbytes, sent, now, payloads=1 if len(new) > 1 and not self.merged else len(new))
        for stamp in sent:
            self.observer.handoff(now - stamp)
        return seen + len(new)
