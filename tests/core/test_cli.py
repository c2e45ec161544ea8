"""The ``omni-plugins`` command line: list, validate, schema."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import RunCli

BAD = Path(__file__).resolve().parents[1] / "data" / "bad_configs"

GOOD_YAML = """
connectors:
  c: {name: memory}
stages:
  - {stage_id: 0, output_connectors: {to_stage_1: c}, custom_process_next_stage_input_func: omni_plugins.testing.builders.passthrough}
  - {stage_id: 1, input_connectors: {from_stage_0: c}}
"""


def test_validate_accepts_good_file(run_cli: RunCli, tmp_path: Path) -> None:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD_YAML)
    proc = run_cli("validate", str(path), with_dummies=False)
    assert proc.returncode == 0, proc.stderr
    assert "ok (2 stages, 1 edges" in proc.stdout


def test_validate_rejects_each_bad_file_with_one_line_per_error(run_cli: RunCli, tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(GOOD_YAML)
    files = [BAD / "cycle.yaml", BAD / "typo_stage_key.yaml", good]
    proc = run_cli("validate", *map(str, files), with_dummies=False)
    assert proc.returncode == 1
    err_lines = proc.stderr.strip().splitlines()
    assert any("cycle.yaml" in line and "cycle" in line for line in err_lines)
    assert any("typo_stage_key.yaml:5:" in line and "did you mean 'worker_type'" in line for line in err_lines)
    assert "good.yaml: ok" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_schema_prints_config_json_schema(run_cli: RunCli) -> None:
    proc = run_cli("schema", "InProcessConnector", with_dummies=False)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema["additionalProperties"] is False
    assert "namespace" in schema["properties"]
    assert schema["x-omni-connector"]["name"] == "memory"


def test_schema_unknown_name_is_a_clear_error(run_cli: RunCli) -> None:
    proc = run_cli("schema", "memroy", with_dummies=False)
    assert proc.returncode == 1
    assert "unknown connector 'memroy'" in proc.stderr and "Did you mean 'memory'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_list_table_shows_failures(run_cli: RunCli) -> None:
    proc = run_cli("list")
    assert proc.returncode == 0
    assert "omni-test-good" in proc.stdout and "loaded" in proc.stdout
    assert "broken: failed: RuntimeError: omni_test_broken exploded on import" in proc.stdout


def test_shm_gc_is_reachable_from_the_core_cli(run_cli: RunCli) -> None:
    import pytest

    pytest.importorskip("omni_plugins_shm")
    proc = run_cli("shm", "gc", "--namespace", "omni-cli-test-empty", "--dry-run", with_dummies=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["dry_run"] is True and report["removed"] == [] and report["errors"] == []


def test_a_reader_that_goes_away_ends_the_output_quietly() -> None:
    """``omni-plugins list --json | head``: the pipe's reader is gone before the first write; no traceback, exit 141."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "omni_plugins", "schema", "memory"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reading end is closed: every write of the child fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
