"""A plugin's services in the commands that use them, with real plugin distributions installed.

``examples/custom-plugin`` (fs-dir: census, reclaim, raw baseline) and ``tests/plugins/served``
(a backend with a server) are pip-installed into a private site directory; each command runs in
a fresh process that finds them through their entry points, as a user's would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_plugins.testing.pytest_plugin import process_running

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = [ROOT / "examples" / "custom-plugin", ROOT / "tests" / "plugins" / "served"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("services-site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile", "--target", str(target)]
    subprocess.run([*pip, *map(str, DISTRIBUTIONS)], check=True, capture_output=True, timeout=300)
    return target


def _run(site: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_PLUGINS", "OMNI_TEST_SERVED"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_bench_measures_a_plugin_backend_against_its_raw_baseline(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run(site, "-m", "omni_plugins", "bench", "--backends", "fs-dir", "--sizes", "1MiB", "--json", str(out), "--quick", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["schema"] == "omni-plugins-bench/1" and data["final"] is False and data["skipped"] == {}
    [row] = data["sections"]["sizes"]["rows"]
    assert row["backend"] == "fs-dir" and row["size"] == 1 << 20 and row["ops"] > 0
    assert row["raw_gbps"] > 0 and row["connector_gbps"] > 0
    assert row["ratio"] == pytest.approx(row["raw_transfer_us"] / row["connector_transfer_us"])
    assert re.search(r"^fs-dir\s+-\s+1MiB\s", proc.stdout, re.M), proc.stdout


def test_bench_names_the_backends_it_can_measure(site: Path) -> None:
    proc = _run(site, "-m", "omni_plugins", "bench", "--backends", "fs-dri", "--no-progress")
    assert proc.returncode == 1
    assert "unknown ['fs-dri']" in proc.stderr and "fs-dir" in proc.stderr and "did you mean fs-dir" in proc.stderr


def test_a_killed_stage_leaves_files_the_run_reports_and_reclaims(site: Path, tmp_path: Path) -> None:
    directory = tmp_path / "payloads"
    directory.mkdir(mode=0o700)
    pipeline = tmp_path / "fs.yaml"
    pipeline.write_text(
        textwrap.dedent(
            f"""
            connectors:
              files: {{name: fs-dir, extra: {{directory: "{directory}"}}}}
            stages:
              - stage_id: 0
                output_connectors: {{to_stage_1: files}}
                synthetic: {{steps: 2, send: full, outputs: [{{name: a.b, shape: [4, 16]}}]}}
              - stage_id: 1
                final_output: true
                input_connectors: {{from_stage_0: files}}
            """
        )
    )
    out = tmp_path / "report.json"
    proc = _run(site, str(Path(__file__).with_name("kill_stage_run.py")), str(pipeline), str(directory), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["ok"] and any("stage 1 rank 0" in d and "SIGKILL" in d for d in report["deaths"]), report
    [leak] = [line for line in report["leaks"] if line.startswith("connector 'files': ")]
    assert "payload file(s) of this run left in" in leak, report["leaks"]
    [freed] = report["reclaimed"]
    assert freed.startswith("connector 'files': removed ") and "payload file(s) of this run" in freed
    assert report["left"] == []  # the run's own reclaim freed them


def test_start_servers_starts_and_stops_a_plugin_server(site: Path, tmp_path: Path) -> None:
    pipeline = tmp_path / "served.yaml"
    # no default for the address: the plugin's server variable stands in until its server runs
    pipeline.write_text(
        textwrap.dedent(
            """
            connectors:
              c: {name: served-dir, extra: {address: "${OMNI_TEST_SERVED}"}}
            stages:
              - stage_id: 0
                async_chunk: true
                output_connectors: {to_stage_1: c}
                synthetic: {steps: 3, send: stream, outputs: [{name: h.s, shape: [1, 8]}]}
              - stage_id: 1
                async_chunk: true
                final_output: true
                input_connectors: {from_stage_0: c}
            """
        )
    )
    report = tmp_path / "r.json"
    proc = _run(site, "-m", "omni_plugins", "run", str(pipeline), "-n", "2", "--start-servers", "--no-progress", "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] and data["edges"][0]["payloads"] == 2 * 3  # the connectors found their directory through the server
    [server] = data["servers"]
    match = re.fullmatch(r"served-dir server pid (\d+) at 127\.0\.0\.1:\d+", server)
    assert match, server
    assert not process_running(int(match.group(1))), "the plugin's server is still running after the run"
    refused = _run(site, "-m", "omni_plugins", "run", str(pipeline), "-n", "1", "--no-progress")
    assert refused.returncode == 1 and "OMNI_TEST_SERVED" in refused.stderr  # without --start-servers nothing sets it
