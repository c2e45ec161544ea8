"""Bodies of the processes that run ``omni-plugins run``'s two roles inside test hosts (importable by the fork server).

A host process coordinates (:func:`coordinate`: the orchestrator, serving the
control channel) or joins (:func:`join`); either starts its own stage
processes from a fork server inside the host, so every socket of the run is
the host's. What each saw goes back on ``out`` as one tuple; the coordinator
also says when the requests start going in (``feeding``), for a fault to be
injected into a running pipeline.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from typing import Any


def _host_environment(address: str) -> None:
    """Before anything starts: what a real machine has -- its own address -- and Mooncake bound to it."""
    multiprocessing.current_process().daemon = False  # it starts stage processes of its own
    os.environ["OMNI_HOST_ADDRESS"] = address  # the pipeline YAML reads it (${OMNI_HOST_ADDRESS})
    os.environ["MC_TCP_BIND_ADDRESS"] = address
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def coordinate(
    path: str, address: str, here: str, stages: list[int], serve: str, secret: bytes, run: dict[str, Any], expected: dict[str, list[int]], out: Any
) -> None:
    try:
        _host_environment(address)
        from omni_plugins.pipeline.control import pipeline_digest
        from omni_plugins.pipeline.launcher import Coordination, RunOptions, prepare

        options = RunOptions(progress=False, **run)
        orchestrator = prepare(path, options, Coordination(here, tuple(stages), serve, secret, pipeline_digest(path), expected))
        wait_ready = orchestrator._wait_ready

        def ready_then_say_so(bar: Any) -> bool:
            ready = wait_ready(bar)
            if ready:
                out.put(("feeding", here, None))  # every stage on every host is ready: requests go in now
            return bool(ready)

        orchestrator._wait_ready = ready_then_say_so  # type: ignore[method-assign]
        out.put(("report", here, orchestrator.run().to_json()))
    except BaseException as exc:
        out.put(("error", here, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def join(path: str, address: str, name: str, stages: list[int], coordinator: str, secret: bytes, out: Any) -> None:
    try:
        _host_environment(address)
        from omni_plugins.pipeline.agent import HostAgent, JoinOptions

        outcome = HostAgent(path, JoinOptions(host=name, stages=tuple(stages), join=coordinator, secret=secret)).run()
        out.put(("joined", name, {"ok": outcome.ok, "problems": outcome.problems, "leaks": outcome.leaks, "reclaimed": outcome.reclaimed}))
    except BaseException as exc:
        out.put(("error", name, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
