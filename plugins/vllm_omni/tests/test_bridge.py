"""omni-plugins over vLLM-Omni's connectors: the ``vllm-omni`` connector wraps what vLLM-Omni's factory builds."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

import torch
from omni_plugins_vllm_omni.bridge import VllmOmniConnector

from omni_plugins import create_connector
from omni_plugins.errors import ConfigError, ConnectorError

SHM = {"connector": "SharedMemoryConnector"}


def _vllm_omni_shm_files(prefix: str) -> list[str]:
    """What vLLM-Omni's SharedMemoryConnector keeps for keys starting with ``prefix``: a segment and a lock file per payload."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix) or n.startswith(f"shm_{prefix}"))


def test_the_bridge_moves_payloads_over_vllm_omnis_shared_memory() -> None:
    producer = create_connector("vllm-omni", SHM)
    consumer = create_connector("vllm-omni", SHM)
    prefix = f"tvo-bridge-{os.getpid()}"
    try:
        assert isinstance(producer, VllmOmniConnector) and type(producer.inner).__name__ == "SharedMemoryConnector"
        assert producer.capabilities.cross_process and not producer.capabilities.cross_host
        payload = {"hidden": torch.randn(4, 8).to(torch.bfloat16), "ids": [1, 2], "meta": {"finished": True}}
        assert producer.put("0", "1", f"{prefix}-a", payload).ok
        got = consumer.get("0", "1", f"{prefix}-a", timeout=10)
        assert got is not None and got.size > 0
        assert torch.equal(got.data["hidden"], payload["hidden"]) and got.data["ids"] == [1, 2] and got.data["meta"] == {"finished": True}
        assert consumer.get("0", "1", f"{prefix}-a") is None  # consumed
        assert consumer.get("0", "1", f"{prefix}-never", timeout=0.05) is None  # a get with a timeout polls, then gives up
        assert producer.put("0", "1", f"{prefix}-b", {"x": 1}).ok
        assert producer.cleanup(f"{prefix}-b")
        assert _vllm_omni_shm_files(prefix) == []
        health = producer.health()
        assert health["ok"] and health["vllm_omni_connector"] == "SharedMemoryConnector"
        assert health["vllm_omni_health"]["status"] == "healthy"
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize(
    ("connector", "reason"),
    [
        ("NixlConnector", "NIXL is not available"),
        ("MoriTransferEngineConnector", "Mori is not available"),
        ("YuanrongConnector", "'datasystem' package"),
    ],
)
@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # vLLM-Omni's half-built YuanrongConnector fails its own __del__
def test_backends_that_need_hardware_or_their_libraries_are_reported_not_faked(connector: str, reason: str) -> None:
    with pytest.raises(ConnectorError, match=f"vLLM-Omni's {connector} cannot be created on this machine: .*{reason}"):
        create_connector("vllm-omni", {"connector": connector, "extra": {"role": "sender", "stage_id": 0}})
    gc.collect()  # that __del__ runs here, inside this test


def test_unknown_and_self_referencing_names_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"vLLM-Omni has no connector 'NoSuchConnector'; its factory knows: .*SharedMemoryConnector"):
        create_connector("vllm-omni", {"connector": "NoSuchConnector"})
    with pytest.raises(ConfigError, match="is omni-plugins itself"):
        create_connector("vllm-omni", {"connector": "OmniPlugins"})
    with pytest.raises(ConfigError, match="extar: Extra inputs are not permitted"):
        create_connector("vllm-omni", {"connector": "SharedMemoryConnector", "extar": {}})


PIPELINE = textwrap.dedent(
    """
    connectors:
      link:
        name: vllm-omni
        extra: {connector: SharedMemoryConnector}
    stages:
      - stage_id: 0
        model_stage: thinker
        async_chunk: true
        kv_transfer: true
        output_connectors: {to_stage_1: link}
        synthetic:
          steps: 8
          send: stream
          outputs:
            - {name: hidden.states, shape: [1, 512], dtype: bfloat16}
          kv: {layers: 2, heads: 2, head_dim: 32, tokens: 24, block_size: 8, dtype: bfloat16}
      - stage_id: 1
        model_stage: talker
        final_output: true
        async_chunk: true
        kv_transfer: true
        input_connectors: {from_stage_0: link}
    """
)


def test_an_omni_plugins_pipeline_runs_over_vllm_omnis_shared_memory_connector(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(PIPELINE)
    report = tmp_path / "report.json"
    before = set(_vllm_omni_shm_files("req-"))
    command = [sys.executable, "-m", "omni_plugins", "run", str(pipeline), "--requests", "6", "--concurrency", "3"]
    out = subprocess.run(
        [*command, "--no-progress", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(report.read_text())
    assert result["ok"] and result["completed"] == 6 and result["mismatches"] == 0 and not result["lost"]
    edges = {edge["edge"]: edge["payloads"] for edge in result["edges"]}
    assert edges == {"0->1 link (stream)": 6 * 8, "0->1 link (KV)": 6}  # 8 chunks and one KV cache per request
    sender, receiver = (stage["health"]["link"]["vllm_omni_health"] for stage in result["stages"])
    assert sender["puts"] == receiver["gets"] == 6 * 8 + 6  # every payload went through vLLM-Omni's connector
    assert set(_vllm_omni_shm_files("req-")) - before == set()  # every segment and lock file consumed
