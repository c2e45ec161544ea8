"""A runtime given ``metrics=`` reports its edges: payloads, bytes, latency, failures, requests in flight, connector health."""

from __future__ import annotations

import pytest
import torch
from rt_helpers import FAST, Req, collect_until, wait_until

from omni_plugins import StageConfig
from omni_plugins.runtime import StageTransferRuntime

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from omni_plugins.metrics import StageMetrics

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}


def _samples(metrics: StageMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _runtime(stage_id: int, namespace: str, metrics: StageMetrics, **stage: object) -> StageTransferRuntime:
    return StageTransferRuntime(
        StageConfig(stage_id=stage_id, **stage), {"name": "memory", "extra": {"namespace": namespace}}, tuning=FAST, metrics=metrics
    )


def test_both_ends_of_an_edge_report_what_crossed_it(runtimes: list, namespace: str) -> None:
    producer_metrics, consumer_metrics = StageMetrics("0"), StageMetrics("1")
    p = _runtime(0, namespace, producer_metrics, **STREAM)
    c = _runtime(1, namespace, consumer_metrics, async_chunk=True, worker_type="ar", recv_timeout_s=0.5)
    runtimes += [p, c]
    edge = {"edge": "0->1", "connector": "memory"}
    c.register_chunk_recv(Req("r1"))
    c.register_chunk_recv(Req("r2"))  # never sent: times out on the receiving side
    mid = _samples(consumer_metrics)
    assert _get(mid, "omni_requests_in_flight", stage="1", direction="receive", **edge) == 2
    req = Req("r1")
    for step in range(3):
        req.done = step == 2
        assert p.send_chunk(req, {"x": {"t": torch.full((4, 8), float(step))}})
    assert p.wait_sends(5)
    collect_until(c, lambda s: "r1" in s.chunk_finished)
    collect_until(c, lambda s: "r2" in s.timed_out)
    c.edge_observer(0, 1).handoff(0.002)  # what a model that knows the send time reports
    sent, got = _samples(producer_metrics), _samples(consumer_metrics)
    assert _get(sent, "omni_payloads_total", stage="0", direction="send", **edge) == 3
    assert _get(got, "omni_payloads_total", stage="1", direction="receive", **edge) == 3
    sent_bytes = _get(sent, "omni_payload_bytes_total", stage="0", direction="send", **edge)
    assert sent_bytes > 3 * 4 * 8 * 4  # the serialized size: tensors plus framing
    assert _get(got, "omni_payload_bytes_total", stage="1", direction="receive", **edge) == sent_bytes
    assert _get(sent, "omni_handoff_latency_seconds_count", stage="0", direction="send", **edge) == 3
    assert _get(got, "omni_handoff_latency_seconds_count", stage="1", direction="receive", **edge) == 1
    assert _get(got, "omni_transfer_failures_total", stage="1", direction="receive", reason="timeout", **edge) == 1
    assert _get(sent, "omni_requests_in_flight", stage="0", direction="send", **edge) == 1  # until cleaned up
    p.cleanup_finished_request("r1")
    c.cleanup_finished_request("r1")
    c.cleanup_finished_request("r2")
    wait_until(lambda: _get(_samples(producer_metrics), "omni_requests_in_flight", stage="0", direction="send", **edge) == 0)
    assert _get(_samples(consumer_metrics), "omni_requests_in_flight", stage="1", direction="receive", **edge) == 0
    assert _get(sent, "omni_connector_up", stage="0", connector="memory") == 1
    assert any(name == "omni_connector_health" for name, _ in sent)
    p.shutdown()
    assert not any(name == "omni_connector_up" for name, _ in _samples(producer_metrics))  # closed connectors are not read


def test_a_put_dropped_after_its_retries_is_a_send_failure(runtimes: list, namespace: str) -> None:
    from rt_helpers import FlakyConnector

    metrics = StageMetrics("0")
    flaky = FlakyConnector(namespace, fail_puts=100)
    p = StageTransferRuntime(StageConfig(stage_id=0, **STREAM), connector=flaky, tuning=FAST, metrics=metrics)
    runtimes.append(p)
    req = Req("r")
    req.done = True
    p.send_chunk(req, {"x": {"t": torch.zeros(2)}})
    collect_until(p, lambda s: "r" in s.failed)
    samples = _samples(metrics)

    def total(name: str, **want: str) -> float:
        return sum(v for (n, labels), v in samples.items() if n == name and want.items() <= dict(labels).items())

    assert total("omni_transfer_failures_total", stage="0", edge="0->1", direction="send", reason="put") == 1
    assert total("omni_payloads_total", stage="0", edge="0->1", direction="send") == 0
