"""examples/vllm-omni: vLLM-Omni's own loader and factory build the example's connectors, and its Redis edge moves payloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

import torch
from omni_plugins_vllm_omni.connector import OmniPluginsConnector
from vllm_omni.distributed.omni_connectors.utils.initialization import (
    create_connectors_from_config,
    get_connectors_config_for_stage,
    load_omni_transfer_config,
)

from omni_plugins.services import services_for

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm-omni" / "qwen3_omni_moe.yaml"


def test_the_example_switches_the_thinker_talker_edge_to_omni_plugins_redis(redis_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, value in services_for("redis").server_environment(redis_server).items():  # OMNI_REDIS_URL, credentials included
        monkeypatch.setenv(variable, value)
    transfer = load_omni_transfer_config(EXAMPLE)
    assert transfer is not None
    specs = transfer.connectors
    assert specs[("0", "1")].name == "OmniPlugins" and specs[("1", "2")].name == "SharedMemoryConnector"
    assert specs[("0", "1")].extra["codec_chunk_frames"] == 25  # still there for the payload builders
    assert get_connectors_config_for_stage(transfer, 1)["from_stage_0"]["spec"]["extra"]["role"] == "receiver"
    sender = create_connectors_from_config({("0", "1"): specs[("0", "1")]}, caller_stage_id=0)[("0", "1")]
    receiver = create_connectors_from_config({("0", "1"): specs[("0", "1")]}, caller_stage_id=1)[("0", "1")]
    try:
        assert isinstance(sender, OmniPluginsConnector) and sender.backend.name == "redis"
        chunk = {"hidden": torch.randn(2, 16).to(torch.bfloat16), "meta": {"finished": torch.tensor(False)}}
        assert sender.put(from_stage="0", to_stage="1", put_key="tvo-example_0_0", data=chunk)[0]
        data, _ = receiver.get(from_stage="0", to_stage="1", get_key="tvo-example_0_0")
        assert torch.equal(data["hidden"], chunk["hidden"])
    finally:
        sender.close()
        receiver.close()
    assert redis_server.keys("qwen3-omni:*") == []
