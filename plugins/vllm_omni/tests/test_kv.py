"""vLLM-Omni's KV transfer manager sends a request's KV cache through ``OmniPlugins``, across processes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

import torch
from omni_plugins_vllm_omni.connector import OmniPluginsConnector
from vllm_omni.distributed.omni_connectors.kv_transfer_manager import OmniKVTransferManager
from vo_helpers import as_plain, backend_extra

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 8, 16, 4, 64


@pytest.fixture(params=["shm", "redis"])
def extra(request: pytest.FixtureRequest, namespace: str) -> dict[str, Any]:
    if request.param == "shm":
        return backend_extra("shm", namespace=namespace)
    return backend_extra("redis", redis=request.getfixturevalue("redis_server"), prefix=request.getfixturevalue("redis_prefix"))


def test_kv_transfer_manager_sends_a_requests_kv_through_omni_plugins(extra: dict[str, Any], stage: Any) -> None:
    connector_config = {"type": "OmniPlugins", **extra}
    sender = OmniKVTransferManager._create(
        {"connector_config": connector_config, "omni_from_stage": "0", "omni_to_stage": "1", "stage_id": 0, "need_send_cache": True}
    )
    gen = torch.Generator().manual_seed(7)
    # the paged KV cache of a stage, FlashAttention layout: [2, num_blocks, block_size, heads, head_dim] per layer
    kv_caches = [torch.randn(2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    finished = {"tvo-kv-a": {"block_ids": [3, 1], "seq_len": 20}, "tvo-kv-b": {"block_ids": [6], "seq_len": 9}}
    try:
        connector = sender.connector
        assert isinstance(connector, OmniPluginsConnector) and connector.supports_raw_data
        assert sender.handle_finished_requests_kv_transfer(finished, kv_caches, BLOCK_SIZE, "bfloat16") == list(finished)
        assert connector.health()["puts"] == len(finished) and connector.health()["errors"] == 0
        received = stage.call("receive_kv", connector_config=connector_config, from_stage=0, stage_id=1, request_ids=list(finished))
    finally:
        sender.connector.close()
    for (rid, spec), data in zip(finished.items(), received, strict=True):
        payload, size = data
        assert size > 0 and payload is not None, rid
        assert payload["request_id"] == rid and payload["block_ids"] == spec["block_ids"]
        assert payload["metadata"]["seq_len"] == spec["seq_len"]
        for layer, kv in enumerate(kv_caches):
            for side, name in enumerate(("key_cache", "value_cache")):
                expected = kv[side][spec["block_ids"]].flatten(0, 1)[: spec["seq_len"]]
                assert payload["layer_blocks"][name][layer] == as_plain(expected), (rid, name, layer)
