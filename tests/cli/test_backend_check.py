"""A stage whose connector cannot reach its backend dies at start with the connection error (no wait for the timeout)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from omni_plugins.errors import ConnectorError
from omni_plugins.pipeline import RunOptions, run_pipeline
from omni_plugins.pipeline.stage import StageRunner
from omni_plugins.ports import free_port

from .conftest import tiny_pipeline


class _Connector:
    name = "fake"

    def __init__(self, health: dict[str, Any]) -> None:
        self._health = health

    def health(self) -> dict[str, Any]:
        return {"connector": self.name, **self._health}


def _runner(health: dict[str, Any]) -> Any:
    rt = SimpleNamespace(connectors={"c": _Connector(health)}, shutdown_calls=0)
    rt.shutdown = lambda: setattr(rt, "shutdown_calls", rt.shutdown_calls + 1)
    return SimpleNamespace(rt=rt)


def test_a_failed_health_check_stops_the_stage() -> None:
    runner = _runner({"ok": False, "error": "ConnectionRefusedError: [Errno 111] Connection refused"})
    with pytest.raises(ConnectorError, match=r"connector 'c' \(fake\) cannot reach its backend: ConnectionRefusedError"):
        StageRunner.check_backend(runner)
    assert runner.rt.shutdown_calls == 1  # the runtime (and its connector) is closed before the stage dies


@pytest.mark.parametrize("health", [{"ok": True}, {"ok": False, "unreachable_peers": ["127.0.0.1:9"]}], ids=["ok", "not-ok-no-error"])
def test_a_healthy_or_possibly_transient_state_starts(health: dict[str, Any]) -> None:
    runner = _runner(health)
    StageRunner.check_backend(runner)  # a peer that is not up yet may be once every stage runs
    assert runner.rt.shutdown_calls == 0



def test_an_unreachable_redis_fails_the_run_at_start(tmp_path: Path) -> None:
    pytest.importorskip("omni_plugins_redis")
    path = tiny_pipeline(tmp_path, name="redis", extra=f'{{url: "redis://127.0.0.1:{free_port()}/0", key_prefix: "cli-down:"}}')
    report = run_pipeline(path, RunOptions(requests=1, progress=False))
    assert not report.ok and report.completed == 0
    assert len(report.deaths) == 2, report.deaths
    for death in report.deaths:
        assert "cannot reach its backend" in death and "Connection refused" in death
    assert not any("timed out" in p or "no request completed" in p for p in report.problems), report.problems
