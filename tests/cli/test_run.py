"""``omni-plugins run``: schema errors, end-to-end checks, dead stages, --start-servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from omni_plugins.config import parse_pipeline_config
from omni_plugins.errors import ConfigError
from omni_plugins.pipeline import RunOptions, build_plan
from omni_plugins.pipeline.checksums import step_output
from omni_plugins.pipeline.inputs import InputCheck
from omni_plugins.pipeline.launcher import Orchestrator
from omni_plugins.pipeline.stats import EdgeStats

from .conftest import tiny_pipeline


def _plan(text: str):  # type: ignore[no-untyped-def]
    return build_plan(parse_pipeline_config(text, filename="p.yaml", check_plugins=False), filename="p.yaml")


BASE = """
connectors: {c: {name: memory}}
stages:
  - stage_id: 0
    async_chunk: true
    output_connectors: {to_stage_1: c}
    synthetic: %s
  - stage_id: 1
    async_chunk: %s
    input_connectors: {from_stage_0: c}
"""


@pytest.mark.parametrize(
    ("synthetic", "receiver_stream", "expected"),
    [
        ("{steps: 0, outputs: [{name: a.b, shape: [1, 2]}]}", "true", "p.yaml: stages[0] (stage 0).synthetic.steps:"),
        ("{outputs: [{name: a.b, shape: [1, 2], dtype: float8}]}", "true", "synthetic.outputs.0.dtype: unknown dtype 'float8'"),
        ("{outputs: [{name: nodot, shape: [1, 2]}]}", "true", "synthetic.outputs.0.name: name must look like 'section.field'"),
        ("{outputs: [{name: a.b, shape: [4]}]}", "true", "synthetic.outputs.0.shape"),
        ("{outputs: [{name: meta.x, shape: [1, 2]}]}", "true", "reserved"),
        ("{stepz: 3, outputs: [{name: a.b, shape: [1, 2]}]}", "true", "synthetic.stepz: unknown field 'stepz'"),
        ("{send: stream, outputs: [{name: a.b, shape: [1, 2]}]}", "false", "synthetic.send: 'stream' needs the receiving stage 1"),
        ("{outputs: [{name: a.b, shape: [1, 2]}], kv: {heads: 8}}", "true", "kv_transfer: must be true on both ends"),
        ("{steps: 2}", "true", "emits no outputs"),
    ],
    ids=["steps", "dtype", "name", "shape-1d", "reserved", "unknown-field", "stream-to-full", "kv-flags", "no-outputs"],
)
def test_synthetic_schema_errors_name_file_stage_field(synthetic: str, receiver_stream: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(BASE % (synthetic, receiver_stream))
    assert expected in str(info.value)


def test_plan_is_the_chain_in_order() -> None:
    plan = _plan(BASE % ("{steps: 3, outputs: [{name: a.b, shape: [1, 2]}]}", "true"))
    assert [s.stage_id for s in plan.stages] == [0, 1]
    assert plan.first.downstreams == (1,) and plan.last.upstreams == (0,) and plan.last.inputs[0].connector == "c"


def _payload(rid: str, steps: list[int], plan, *, corrupt: bool = False) -> dict:  # type: ignore[no-untyped-def]
    up = plan.first
    spec = up.synthetic.outputs[0]
    tensor = torch.cat([step_output(up.synthetic.seed, rid, 0, spec, s) for s in steps])
    if corrupt:
        tensor = tensor.clone()
        tensor.view(-1)[1] += 1
    return {
        "a": {"b": tensor},
        "trace": {"step": torch.tensor([[s] for s in steps]), "sent_at": torch.full((len(steps), 1), time.time(), dtype=torch.float64)},
    }


def test_input_check_accepts_exact_and_flags_corruption_loss_and_dtype() -> None:
    plan = _plan(BASE % ("{steps: 3, outputs: [{name: a.b, shape: [1, 2]}]}", "true"))
    stats = EdgeStats("e")
    check = InputCheck(plan.first, to_stage=1, merged=True, stats=stats)
    assert check.check("r", _payload("r", [0, 1], plan), 0) == 2
    assert check.check("r", _payload("r", [0, 1, 2], plan), 2) == 3  # merged: only row 2 is new
    assert stats.payloads == 3 and stats.mismatches == 0
    assert check.check("x", _payload("x", [0], plan, corrupt=True), 0) == 0
    assert check.check("y", _payload("y", [1], plan), 0) == 0  # step 0 missing
    wrong = _payload("z", [0], plan)
    wrong["a"]["b"] = wrong["a"]["b"].to(torch.float16)
    assert check.check("z", wrong, 0) == 0
    assert stats.mismatches == 3
    assert any("values differ" in e for e in stats.errors) and any("dtype" in e for e in stats.errors)
    assert any("lost, duplicated or out of order" in e for e in stats.errors)


def test_run_reports_a_killed_stage_and_leaves_nothing_running(tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    from omni_plugins.config import load_pipeline_config

    path = tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}", steps=100000)
    plan = build_plan(load_pipeline_config(path), filename=str(path))
    orch = Orchestrator(plan, RunOptions(requests=2, concurrency=1, progress=False, stall_s=60, stop_timeout_s=20))
    original = orch._wait_ready

    def ready_then_kill(bar):  # type: ignore[no-untyped-def]
        ok = original(bar)
        victim = next(p for p in orch.procs if p.stage == 1)
        os.kill(victim.process.pid, 9)
        return ok

    orch._wait_ready = ready_then_kill  # type: ignore[method-assign]
    started = time.monotonic()
    report = orch.run()
    assert time.monotonic() - started < 120
    assert not report.ok
    assert any("stage 1 rank 0" in d and "SIGKILL" in d for d in report.deaths), report.deaths
    assert report.lost  # the request in flight never completed
    for p in orch.procs:
        assert p.process.exitcode is not None
        assert not psutil.pid_exists(p.process.pid) or psutil.Process(p.process.pid).status() == psutil.STATUS_ZOMBIE
    # the survivors' in-flight requests were aborted before the leak count: not reported as held state
    assert not any("runtime still holds" in leak for leak in report.leaks), report.leaks
    # what the killed stage left (at least its liveness marker) is reported, then freed by the run itself
    assert any("shm file(s) left" in leak for leak in report.leaks), report.leaks
    assert any("removed" in r and "shm file(s)" in r for r in report.reclaimed), report.reclaimed
    assert namespace_segments(shm_ns) == []


def test_cli_run_bad_file_exits_1_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_plugins.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text((BASE % ("{steps: -1, outputs: [{name: a.b, shape: [1, 2]}]}", "true")).replace("memory", "shm"))
    assert main(["run", str(bad), "--no-progress"]) == 1
    assert "bad.yaml: stages[0] (stage 0).synthetic.steps" in capsys.readouterr().err


def test_cli_run_start_servers_redis(tmp_path: Path) -> None:
    pytest.importorskip("omni_plugins_redis.testing")
    import re

    path = tiny_pipeline(tmp_path, name="redis", extra='{url: "${OMNI_REDIS_URL:-redis://127.0.0.1:1/0}", key_prefix: "cli-t:"}')
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "omni_plugins", "run", str(path), "-n", "3", "-c", "2", "--start-servers", "--no-progress"]
    proc = subprocess.run([*cmd, "--report", str(report)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] and data["edges"][0]["payloads"] == 3 * 4
    started = [s for s in data["servers"] if s.startswith("redis server pid ")]
    assert len(started) == 1 and " at 127.0.0.1:" in started[0] and "@" not in started[0]  # the password stays out of reports
    pid = int(re.search(r"pid (\d+)", started[0]).group(1))  # type: ignore[union-attr]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "the private redis-server is still running"


def test_stage_exception_is_reported_with_its_message(tmp_path: Path) -> None:
    from omni_plugins.pipeline import run_pipeline

    path = tiny_pipeline(tmp_path, extra=f"{{namespace: bad, shm_dir: {tmp_path / 'missing'}}}")
    report = run_pipeline(path, RunOptions(requests=1, progress=False))
    assert not report.ok and report.completed == 0
    # both stages fail creating the connector; the first death stops the run, and a stage that reads the stop
    # before it gets that far ends cleanly: one death or two, each with its stage and the error's message
    assert 1 <= len(report.deaths) <= 2
    stages = set()
    for death in report.deaths:
        assert "exit code 1 (ConfigError" in death and "is not a directory" in death
        stages |= {s for s in (0, 1) if f"stage {s} rank 0" in death}
    assert len(stages) == len(report.deaths)


def test_exit_reasons() -> None:
    from omni_plugins.pipeline.launcher import exit_reason

    assert exit_reason(-9) == "killed by signal SIGKILL"
    assert exit_reason(-11) == "killed by signal SIGSEGV"
    assert exit_reason(3) == "exit code 3"


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_timeout_must_be_a_finite_positive_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_plugins.cli import main

    with pytest.raises(SystemExit) as info:
        main(["run", "p.yaml", "--timeout", value])
    assert info.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_bench_refuses_an_empty_backend_list(capsys: pytest.CaptureFixture[str]) -> None:
    from omni_plugins.cli import main

    assert main(["bench", "--backends", ","]) == 1
    assert "--backends needs at least one backend" in capsys.readouterr().err


def test_requests_are_lost_when_every_stage_dies_at_start(tmp_path: Path) -> None:
    from omni_plugins.pipeline import run_pipeline

    path = tiny_pipeline(tmp_path, extra=f"{{namespace: bad, shm_dir: {tmp_path / 'missing'}}}")
    report = run_pipeline(path, RunOptions(requests=2, progress=False))
    assert report.deaths and report.completed == 0 and not report.failed
    assert len(report.lost) == 2
    assert "0/2 requests completed" in report.table() and "lost 2, failed 0" in report.table()


def test_every_request_is_completed_failed_or_lost_after_a_timeout(tmp_path: Path, shm_ns: str) -> None:
    """Requests that complete while the stages stop are not also counted lost."""
    from omni_plugins.pipeline import run_pipeline

    path = tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}", steps=2)
    report = run_pipeline(path, RunOptions(requests=3, concurrency=3, timeout_s=1e-6, progress=False))
    assert any("timed out" in p for p in report.problems)
    assert report.completed + len(report.failed) + len(report.lost) == 3
    assert not set(report.lost) & set(report.failed)
