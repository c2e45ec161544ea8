"""Shared pieces of the vLLM-Omni integration tests (importable without vLLM-Omni)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

MIB = 1 << 20


def backend_extra(backend: str, *, namespace: str = "", redis: Any = None, prefix: str = "", **settings: Any) -> dict[str, Any]:
    """``extra`` of an ``OmniPlugins`` connector on ``backend``: small shm pools (tests), or the test's Redis prefix."""
    if backend == "shm":
        config = {"namespace": namespace, "pool_bytes": 4 * MIB, "slot_count": 32, **settings}
    else:
        config = {**redis.connector_config(key_prefix=prefix), **settings}
    return {"backend": backend, "backend_config": config}


def deploy_config(extra: dict[str, Any], *, name: str = "OmniPlugins") -> dict[str, Any]:
    """A two-stage vLLM-Omni deploy config (current layout) whose edge 0 -> 1 uses connector ``name``."""
    return {
        "async_chunk": False,
        "connectors": {"edge": {"name": name, "extra": {**extra, "codec_chunk_frames": 25}}},
        "stages": [
            {"stage_id": 0, "max_num_seqs": 4, "output_connectors": {"to_stage_1": "edge"}},
            {"stage_id": 1, "max_num_seqs": 4, "input_connectors": {"from_stage_0": "edge"}},
        ],
    }


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def engine_inputs(seed: int, hidden_tokens: int = 16) -> dict[str, Any]:
    """Stage inputs as a thinker hands them to a talker: token ids plus hidden states (bf16) and codes."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "prompt_token_ids": [int(x) for x in torch.randint(0, 150000, (12,), generator=gen)],
        "additional_information": {
            "thinker_hidden": torch.randn(hidden_tokens, 1024, generator=gen).to(torch.bfloat16),
            "thinker_ids": torch.randint(0, 150000, (hidden_tokens,), generator=gen),
            "voice": "Chelsie",
        },
        "multi_modal_data": None,
    }


def as_plain(obj: Any) -> Any:
    from omni_plugins_vllm_omni.testing import plain

    return plain(obj)
