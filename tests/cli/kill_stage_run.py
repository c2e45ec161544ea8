"""``python kill_stage_run.py PIPELINE.yaml DIRECTORY OUT.json``: a run whose consumer stage is SIGKILLed.

Stage 1 (the consumer) is killed as soon as every stage is ready; the run takes note of deaths
only once the producer has put a payload file (in DIRECTORY) that nobody will read, and then the
producer is killed too (a producer stopped in order frees what it put for the requests it aborts,
which would leave nothing behind), so the run ends with a leftover the backend's census must report and
its reclaim must free. Writes the report's leaks, reclaimed lines and deaths, and the run's files
left in DIRECTORY afterwards, to OUT.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from omni_plugins.config import load_pipeline_config
from omni_plugins.pipeline.launcher import Orchestrator, RunOptions
from omni_plugins.pipeline.leaks import run_id_prefix
from omni_plugins.pipeline.spec import build_plan


def main() -> None:
    path, directory, out = sys.argv[1:4]
    plan = build_plan(load_pipeline_config(path), filename=path)
    orch = Orchestrator(plan, RunOptions(requests=4, concurrency=2, progress=False, stall_s=60, stop_timeout_s=20))
    run_files = "k-" + run_id_prefix(orch.run_tag).encode().hex()  # fs-dir names a payload file after its key
    wait_ready, deaths = orch._wait_ready, orch._deaths
    deadline = time.monotonic() + 60

    def ready_then_kill(bar: Any) -> bool:
        ok = wait_ready(bar)
        victim = next(p for p in orch.procs if p.stage == 1)
        os.kill(victim.process.pid, signal.SIGKILL)
        return ok

    def deaths_once_a_payload_waits(bar: Any) -> bool:
        """The feed loop's look for deaths: none until a payload waits; then the producer dies too."""
        waiting = any(n.startswith(run_files) for n in os.listdir(directory))
        if not waiting and time.monotonic() < deadline:
            return True
        producer = next(p for p in orch.procs if p.stage == 0)
        if producer.process.exitcode is None:
            os.kill(producer.process.pid, signal.SIGKILL)
            producer.process.join(10)
        return deaths(bar)

    orch._wait_ready = ready_then_kill  # type: ignore[method-assign]
    orch._deaths = deaths_once_a_payload_waits  # type: ignore[method-assign]
    report = orch.run()
    left = sorted(n for n in os.listdir(directory) if n.startswith(run_files))
    result = {"ok": report.ok, "deaths": report.deaths, "leaks": report.leaks, "reclaimed": report.reclaimed, "left": left}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
