"""The producer stage of the multi-process tests and benchmark (spawned; imported by path).

``serve(cmds, results)`` runs in a child process and executes commands from a
queue, so one (slow) spawn serves several scenarios:

* ``("produce", name, config, n, chunks)``: stage 0 streams ``n`` requests of
  ``chunks`` chunks (``s{i}``) and sends ``n`` full payloads (``f{i}``), then
  reports ``("sent", stats)`` and keeps its connectors open until ``"close"``.
* ``"close"``: clean up, shut down, report ``("closed", leftover_state_count)``.
* ``None``: exit.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from omni_plugins import StageConfig
from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime


class Req:
    def __init__(self, rid: str, done: bool = False) -> None:
        self.request_id = rid
        self.external_req_id = rid
        self.done = done

    def is_finished(self) -> bool:
        return self.done


def chunk_of(i: int, k: int) -> dict[str, Any]:
    return {"embed": {"decode": torch.full((2, 8), float(i * 100 + k))}, "ids": {"output": [k]}}


def full_of(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {"hidden": torch.randn((16, 32), generator=g), "name": f"f{i}", "meta": {"next_stage_prompt_len": i}}


def serve(cmds: Any, results: Any) -> None:
    runtimes: list[StageTransferRuntime] = []
    ids: list[str] = []
    while True:
        cmd = cmds.get()
        if cmd is None:
            return
        try:
            if cmd == "close":
                for rt in runtimes:
                    rt.wait_sends(30)
                    for rid in ids:
                        rt.cleanup_finished_request(rid)
                left = sum(rt.active_request_count() for rt in runtimes)
                for rt in runtimes:
                    rt.shutdown()
                runtimes, ids = [], []
                results.put(("closed", left))
                continue
            _, name, config, n, chunks = cmd
            conn = {"name": name, "extra": config}
            tuning = RuntimeTuning(join_timeout_s=5.0)
            streamer = StageTransferRuntime(
                StageConfig(stage_id=0, async_chunk=True, custom_process_next_stage_input_func="rt_builders.stream"), conn, tuning=tuning
            )
            whole = StageTransferRuntime(StageConfig(stage_id=0), conn, tuning=tuning)
            runtimes = [streamer, whole]
            ids = [f"s{i}" for i in range(n)] + [f"f{i}" for i in range(n)]
            for k in range(chunks):
                for i in range(n):
                    assert streamer.send_chunk(Req(f"s{i}", done=k == chunks - 1), chunk_of(i, k))
            assert whole.send_full_payload_outputs({f"f{i}": full_of(i) for i in range(n)}) == [f"f{i}" for i in range(n)]
            ok = all(rt.wait_sends(60) for rt in runtimes)
            results.put(("sent", ok, [rt.debug_state()["sender"] for rt in runtimes]))
        except Exception:
            results.put(("error", traceback.format_exc()))
