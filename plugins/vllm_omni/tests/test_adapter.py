"""vLLM-Omni's own orchestrator path over omni-plugins backends, across processes.

The test process is stage 0: vLLM-Omni's ``load_omni_transfer_config`` reads a deploy YAML naming
``OmniPlugins``, ``create_connectors_from_config`` builds the connector, ``try_send_via_connector``
sends. The fresh stage process is stage 1: the same loader and factory, ``try_recv_via_connector``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

import msgspec
import torch
from omni_plugins_vllm_omni.connector import OmniPluginsConnector
from omni_plugins_vllm_omni.payloads import BLOB, ENVELOPE
from PIL import Image
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm_omni.distributed.omni_connectors.adapter import try_send_via_connector
from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
from vllm_omni.distributed.omni_connectors.utils.initialization import (
    create_connectors_from_config,
    load_omni_transfer_config,
)
from vllm_omni.metrics import OrchestratorAggregator
from vo_helpers import MIB, as_plain, backend_extra, deploy_config, engine_inputs, write_yaml

from omni_plugins import create_connector


@pytest.fixture(params=["shm", "redis"])
def extra(request: pytest.FixtureRequest, namespace: str) -> dict[str, Any]:
    if request.param == "shm":
        return backend_extra("shm", namespace=namespace)
    redis = request.getfixturevalue("redis_server")
    return backend_extra("redis", redis=redis, prefix=request.getfixturevalue("redis_prefix"))


def test_adapter_functions_round_trip_payloads_across_processes(extra: dict[str, Any], stage: Any, tmp_path: Path) -> None:
    config = deploy_config(extra)
    transfer = load_omni_transfer_config(write_yaml(tmp_path / "deploy.yaml", config))
    connectors = create_connectors_from_config(transfer.connectors, caller_stage_id=0)
    producer = connectors[("0", "1")]
    assert isinstance(producer, OmniPluginsConnector) and producer.backend.name == extra["backend"]
    metrics = OrchestratorAggregator(2, False, time.time(), 1)
    tasks: list[dict[str, Any]] = []
    sent = {}
    try:
        for i, tokens in enumerate([4, 16, 1024]):  # the last one is 2 MiB: the backends' large-payload path
            rid = f"tvo-req-{i}"
            sent[rid] = engine_inputs(i, hidden_tokens=tokens)
            params = SamplingParams(temperature=0.9, top_k=50, max_tokens=64, seed=42)
            assert try_send_via_connector(producer, 0, 1, rid, sent[rid], params, {"prompt": "hi"}, tasks.append, metrics)
        assert [t["request_id"] for t in tasks] == list(sent)
        assert all("connector_metadata" not in t for t in tasks)  # gets work from the key alone
        result = stage.call("receive_stage_inputs", config=config, stage_id=1, tasks=tasks)
        producer.reap_consumed()
        assert producer.health()["pending"] == 0
    finally:
        for connector in connectors.values():
            connector.close()
    assert result["kinds"] == {"0->1": "OmniPluginsConnector"}
    for rid, (inputs, rx) in zip(sent, result["received"], strict=True):
        assert inputs == as_plain(sent[rid]), rid
        assert rx["rx_transfer_bytes"] > 0
    assert sent["tvo-req-2"]["additional_information"]["thinker_hidden"].nbytes == 2 * MIB
    health = result["health"]["0->1"]
    assert health["status"] == "healthy" and health["gets"] == 3 and health["errors"] == 0


def _pair(extra: dict[str, Any]) -> tuple[Any, Any]:
    spec = ConnectorSpec(name="OmniPlugins", extra={**extra, "stage_id": 0})
    return OmniConnectorFactory.create_connector(spec), OmniConnectorFactory.create_connector(spec)


def test_payload_types_arrive_as_vllm_omni_delivers_them(extra: dict[str, Any]) -> None:
    producer, consumer = _pair(extra)
    params = SamplingParams(temperature=0.5, stop=["\n"], max_tokens=7)
    image = Image.new("RGB", (4, 3), (10, 20, 30))
    completion = CompletionOutput(index=0, text="hi", token_ids=[1, 2], cumulative_logprob=None, logprobs=None, finish_reason="stop")
    output = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], prompt_logprobs=None, outputs=[completion], finished=True)
    payload = {"params": params, "image": image, "output": output, "by_layer": {0: torch.ones(2)}, "hidden": torch.zeros(3)}
    try:
        assert producer.put(from_stage="0", to_stage="1", put_key="types", data=payload)[0]
        data, size = consumer.get(from_stage="0", to_stage="1", get_key="types")
        assert size > 0
        # a Struct arrives as the dict vLLM-Omni's own serializer makes of it (msgspec: fields at their default left out)
        assert data["params"] == msgspec.msgpack.decode(msgspec.msgpack.encode(params))
        assert data["params"]["stop"] == ["\n"] and "top_k" not in data["params"]
        assert isinstance(data["image"], Image.Image) and data["image"].tobytes() == image.tobytes()
        assert isinstance(data["output"], RequestOutput) and data["output"].outputs[0].text == "hi"
        assert torch.equal(data["by_layer"][0], torch.ones(2))
        assert torch.equal(data["hidden"], torch.zeros(3))
        # something neither the wire format nor vLLM-Omni's serializer takes: put fails in vLLM-Omni's shape
        assert producer.put(from_stage="0", to_stage="1", put_key="bad", data={"f": object()}) == (False, 0, None)
        assert producer.health()["errors"] == 1
    finally:
        producer.close()
        consumer.close()


def test_get_with_deadline_blocks_on_the_backend(extra: dict[str, Any]) -> None:
    producer, consumer = _pair(extra)
    try:
        assert consumer.get_with_deadline("0", "1", "late", deadline=time.monotonic() + 0.2) is None
        assert consumer.get("0", "1", "late") is None  # key-only, non-blocking

        import threading

        timer = threading.Timer(0.2, lambda: producer.put(from_stage="0", to_stage="1", put_key="late", data={"v": 1}))
        timer.start()
        got = consumer.get_with_deadline("0", "1", "late", {"source_host": "ignored"}, deadline=time.monotonic() + 30)
        timer.join()
        assert got is not None and got[0] == {"v": 1}
    finally:
        producer.close()
        consumer.close()


def test_errors_and_health_take_vllm_omni_shapes(extra: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    producer, consumer = _pair(extra)
    backend = create_connector(extra["backend"], extra["backend_config"])
    try:
        health = producer.health()
        assert health["status"] == "healthy" and health["backend_health"]["ok"] is True
        assert {"puts", "gets", "bytes_transferred", "errors"} <= set(health)
        # a payload whose serializer part is no msgpack: consumed, logged, None (as vLLM-Omni's connectors answer)
        backend.put("0", "1", "junk.0_1", {ENVELOPE: 1, "payload": {"x": {BLOB: b"\xc1 not msgpack"}}})
        assert consumer.get("0", "1", "junk") is None
        assert consumer.health()["errors"] == 1 and "junk" in caplog.text and "corrupt" in caplog.text
        assert backend.get("0", "1", "junk.0_1") is None  # discarded, not left behind
    finally:
        producer.close()
        consumer.close()
        backend.close()
    closed = producer.health()
    assert closed["status"] == "unhealthy" and closed["error"] == "connector closed"
    assert producer.put("0", "1", "after-close", {"v": 1}) == (False, 0, None)
    producer.close()  # idempotent
