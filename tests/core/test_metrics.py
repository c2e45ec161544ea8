"""Stage metrics: a runtime-shaped producer/consumer reports through edge observers; a real HTTP scrape reads it back."""

from __future__ import annotations

import sys
import time
import urllib.request

import pytest
import torch

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from omni_plugins import create_connector
from omni_plugins.metrics import NO_OBSERVER, StageMetrics, require_prometheus, served


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_counts_scraped_over_http_match_what_crossed_the_edge() -> None:
    sizes = [1000, 50_000, 3]
    with create_connector("memory", {}) as conn, served("1") as metrics:
        send = metrics.edge("0->1", "memory", "send")
        receive = metrics.edge("0->1", "memory", "receive")
        metrics.watch_connector("memory", conn.health)
        sent_bytes = received_bytes = 0
        for i, n in enumerate(sizes):
            send.started()
            put = conn.put(0, 1, f"k{i}", {"t": torch.zeros(n, dtype=torch.uint8), "stamp": time.time()})
            send.delivered(put.size)
            sent_bytes += put.size
            receive.started()
            got = conn.get(0, 1, f"k{i}", timeout=5)
            assert got is not None
            receive.delivered(got.size, latency=time.time() - got.data["stamp"])
            received_bytes += got.size
        receive.started()
        assert conn.get(0, 1, "never-put") is None
        receive.failed("timeout")
        receive.started()  # one request still in flight at the scrape
        assert metrics.port is not None
        samples = _scrape(metrics.port)
    edge = {"stage": "1", "edge": "0->1", "connector": "memory"}
    assert _value(samples, "omni_payloads_total", direction="send", **edge) == len(sizes)
    assert _value(samples, "omni_payloads_total", direction="receive", **edge) == len(sizes)
    assert _value(samples, "omni_payload_bytes_total", direction="send", **edge) == sent_bytes
    assert _value(samples, "omni_payload_bytes_total", direction="receive", **edge) == received_bytes == sent_bytes
    assert _value(samples, "omni_handoff_latency_seconds_count", direction="receive", **edge) == len(sizes)
    assert _value(samples, "omni_handoff_latency_seconds_bucket", direction="receive", le="+Inf", **edge) == len(sizes)
    assert ("omni_handoff_latency_seconds_count", tuple(sorted({**edge, "direction": "send"}.items()))) in samples  # no observations
    assert _value(samples, "omni_transfer_failures_total", direction="receive", reason="timeout", **edge) == 1
    assert _value(samples, "omni_requests_in_flight", direction="receive", **edge) == 1
    assert _value(samples, "omni_requests_in_flight", direction="send", **edge) == 0
    assert _value(samples, "omni_connector_up", stage="1", connector="memory") == 1
    health_fields = {dict(labels)["field"] for name, labels in samples if name == "omni_connector_health"}
    assert health_fields, "the memory connector's numeric health fields"
    assert "ok" not in health_fields


def test_health_is_read_at_scrape_time_and_a_failing_backend_reads_as_down() -> None:
    state = {"ok": True, "staged": 2, "pool": {"in_use_bytes": 10, "name": "x"}, "flag": False}

    def health() -> dict:
        if state.get("raise"):
            raise ConnectionError("backend gone")
        return state

    metrics = StageMetrics("0")
    metrics.watch_connector("fake", health)
    port = metrics.serve()
    try:
        samples = _scrape(port)
        assert _value(samples, "omni_connector_health", stage="0", connector="fake", field="staged") == 2
        assert _value(samples, "omni_connector_health", stage="0", connector="fake", field="pool.in_use_bytes") == 10
        assert _value(samples, "omni_connector_health", stage="0", connector="fake", field="flag") == 0
        state["staged"], state["ok"] = 0, False
        samples = _scrape(port)
        assert _value(samples, "omni_connector_health", stage="0", connector="fake", field="staged") == 0
        assert _value(samples, "omni_connector_up", stage="0", connector="fake") == 0
        state["raise"] = True
        samples = _scrape(port)  # the scrape still answers
        assert _value(samples, "omni_connector_up", stage="0", connector="fake") == 0
        metrics.unwatch_connector("fake")
        assert not [k for k in _scrape(port) if k[0] == "omni_connector_up"]
    finally:
        metrics.close()
        metrics.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_two_stages_in_one_process_do_not_collide() -> None:
    a, b = StageMetrics("0"), StageMetrics("1")
    a.edge("0->1", "shm", "send").delivered(5)
    assert b"omni_payloads_total{" not in b.exposition()
    assert a.edge("0->1", "shm", "send") is a.edge("0->1", "shm", "send")
    with pytest.raises(ValueError, match="direction"):
        a.edge("0->1", "shm", "sideways")  # type: ignore[arg-type]


def test_no_observer_does_nothing_and_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    NO_OBSERVER.started()
    NO_OBSERVER.delivered(10, 0.1)
    NO_OBSERVER.failed("timeout")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(RuntimeError, match=r"omni-plugins\[metrics\]"):
        require_prometheus()
    with pytest.raises(RuntimeError, match=r"omni-plugins\[metrics\]"):
        StageMetrics("0")
