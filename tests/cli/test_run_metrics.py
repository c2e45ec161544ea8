"""``omni-plugins run --metrics-port``: a real scrape of the host's endpoint agrees with the run's report."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from omni_plugins.ports import free_port

from .conftest import tiny_pipeline

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(value for n, have, value in samples if n == name and labels.items() <= have.items())


def _read(report: Path) -> dict | None:
    """The report once it is written in full."""
    try:
        return dict(json.loads(report.read_text()))
    except (OSError, ValueError):
        return None


def test_scraped_counts_match_the_report(tmp_path: Path, shm_ns: str) -> None:
    path = tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}", steps=5)
    report, port = tmp_path / "report.json", free_port()
    cmd = [sys.executable, "-m", "omni_plugins", "run", str(path), "-n", "4", "-c", "2", "--no-progress", "--report", str(report)]
    proc = subprocess.Popen([*cmd, "--metrics-port", str(port), "--metrics-linger", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while _read(report) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]  # lingering: the final metrics are still served
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            samples = _samples(reply.read().decode())
    finally:
        proc.send_signal(signal.SIGINT)  # ends the linger
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] and data["metrics"] == f"http://127.0.0.1:{port}/metrics"
    (edge,) = data["edges"]
    assert edge["edge"] == "0->1 c (stream)" and edge["payloads"] == 4 * 5
    one_edge = {"edge": "0->1", "connector": "c"}
    for direction, stage in (("send", "0"), ("receive", "1")):
        assert _total(samples, "omni_payloads_total", stage=stage, direction=direction, **one_edge) == edge["payloads"]
        assert _total(samples, "omni_requests_in_flight", stage=stage, direction=direction, **one_edge) == 0
        assert _total(samples, "omni_transfer_failures_total", direction=direction) == 0
    sent = _total(samples, "omni_payload_bytes_total", direction="send", **one_edge)
    assert sent == _total(samples, "omni_payload_bytes_total", direction="receive", **one_edge) > edge["bytes"]  # framing included
    # every hand-off the report measured (the producer's trace stamps) is in the receive-side histogram
    assert _total(samples, "omni_handoff_latency_seconds_count", direction="receive", **one_edge) == edge["latency_samples"]
    assert _total(samples, "omni_handoff_latency_seconds_count", direction="send", **one_edge) == edge["payloads"]
    assert {have["stage"] for n, have, v in samples if n == "omni_connector_up" and v == 1} == {"0", "1"}
    assert {have["field"] for n, have, _ in samples if n == "omni_connector_health" and have["stage"] == "1"}  # shm's own fields
