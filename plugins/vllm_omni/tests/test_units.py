"""Unit tests of the vLLM-Omni plugin's parts that need no vLLM-Omni: the extra split, keys, the pending record, payload conversion."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from omni_plugins_vllm_omni.extra import INJECTED_KEYS, split_extra
from omni_plugins_vllm_omni.keys import belongs_to, edge_key
from omni_plugins_vllm_omni.payloads import ENVELOPE, from_wire, to_wire
from omni_plugins_vllm_omni.pending import PendingPuts

from omni_plugins import wire


# -- the extra split ------------------------------------------------------------------------------
def test_split_keeps_backend_settings_apart_from_injected_keys_and_other_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TVO_REDIS_URL", "redis://127.0.0.1:7000/0")
    extra = {
        "backend": "redis",
        "backend_config": {"url": "${TVO_REDIS_URL}", "key_prefix": "${TVO_UNSET:-omni:}", "startup_nodes": ["${TVO_REDIS_URL}"]},
        "stage_id": "2",
        "role": "receiver",
        "from_stage": 1,
        "to_stage": 2,
        "codec_chunk_frames": 25,
        "connector_get_sleep_s": 0.01,
    }
    settings = split_extra(extra)
    assert settings.backend == "redis"
    assert settings.backend_config == {
        "url": "redis://127.0.0.1:7000/0",
        "key_prefix": "omni:",
        "startup_nodes": ["redis://127.0.0.1:7000/0"],
    }
    assert settings.stage_id == 2  # vLLM-Omni's chunk adapter computes stage_id - 1
    assert settings.injected == {"stage_id": "2", "role": "receiver", "from_stage": 1, "to_stage": 2}
    assert settings.ignored == ("codec_chunk_frames", "connector_get_sleep_s")
    assert set(settings.injected) <= INJECTED_KEYS


def test_split_defaults_to_shm_and_names_bad_values() -> None:
    assert split_extra(None).backend == "shm"
    assert split_extra({}).stage_id == -1
    with pytest.raises(ValueError, match=r"extra\.backend must be"):
        split_extra({"backend": ""})
    with pytest.raises(ValueError, match="backend_config must be a mapping"):
        split_extra({"backend": "redis", "backend_config": "redis://x"})
    with pytest.raises(ValueError, match=r"extra.backend_config.url: environment variable 'TVO_NOT_SET_ANYWHERE'"):
        split_extra({"backend_config": {"url": "${TVO_NOT_SET_ANYWHERE}"}})
    with pytest.raises(ValueError, match="stage_id must be an int"):
        split_extra({"stage_id": 1.5})


def test_a_misspelled_own_key_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_plugins_vllm_omni"):
        settings = split_extra({"backnd": "redis", "codec_chunk_frames": 25})
    assert settings.backend == "shm"
    assert "'backnd' is not read (did you mean 'backend'?)" in caplog.text
    assert "codec_chunk_frames" not in caplog.text


# -- keys -------------------------------------------------------------------------------------------
def test_edge_keys_are_readable_and_start_with_the_key() -> None:
    assert edge_key("req-1", "0", 1) == "req-1.0_1"


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("req-1", True),
        ("req-1_0_3", True),  # a chunk
        ("req-1_0_0_1_0", True),  # a KV shard for one TP rank
        ("omni_0_to_1_kv_cache_req-1", True),  # a request's KV
        ("req-10", False),
        ("req-1_0", False),
        ("req-1_0_x", False),
        ("req-1x_0_3", False),
        ("omni_0_to_1_kv_cache_req-10", False),
        ("xomni_0_to_1_kv_cache_req-1", False),
    ],
)
def test_which_keys_belong_to_a_request(key: str, owner: bool) -> None:
    assert belongs_to(key, "req-1") is owner


def test_pending_puts_by_request_consumed_and_bounded() -> None:
    pending = PendingPuts(limit=4)
    pending.add("r1", "r1.0_1")
    pending.add("r1_0_0", "r1_0_0.0_1")
    pending.add("r1_0_1", "r1_0_1.0_1")
    pending.add("r2", "r2.0_1")
    pending.discard(["r1_0_1.0_1"])  # consumed
    assert sorted(pending.take_request("r1")) == ["r1.0_1", "r1_0_0.0_1"]
    assert pending.take_request("r1") == []
    for i in range(6):
        pending.add(f"r3_0_{i}", f"r3_0_{i}.0_1")
    assert len(pending) == 4 and pending.take_request("r2") == []  # the oldest were dropped (left to the backend's expiry)
    pending.keep_only(pending.snapshot(), lambda keys: [k for k in keys if k.startswith("r3_0_5")])
    assert pending.snapshot() == ["r3_0_5.0_1"]


# -- payloads ------------------------------------------------------------------------------------------
class Colour(enum.Enum):
    RED = "red"


class Kind(enum.IntEnum):
    A = 3


@dataclasses.dataclass
class Params:
    temperature: float
    stop: set[str]


def test_payload_types_the_wire_format_refuses_are_converted_explicitly() -> None:
    hidden = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    payload = {
        "hidden": hidden,
        "ids": [1, 2, 3],
        "pair": (1, "a"),
        "params": Params(0.5, {"x"}),
        "tags": frozenset({"a"}),
        "raw": bytearray(b"ab"),
        "view": memoryview(b"cd"),
        "span": slice(1, 5, None),
        "colour": Colour.RED,
        "kind": Kind.A,
        "scalar": np.float32(1.5),
        "array": np.arange(3, dtype=np.int16),
    }
    converted = to_wire(payload)
    assert ENVELOPE not in converted  # no serializer needed: returned as is by from_wire
    back = from_wire(wire.decode(wire.encode(converted).to_bytes(), copy=True))
    assert torch.equal(back["hidden"], hidden) and back["hidden"].dtype == torch.bfloat16
    assert back["params"] == {"temperature": 0.5, "stop": ["x"]}
    assert back["tags"] == ["a"] and back["raw"] == b"ab" and back["view"] == b"cd"
    assert back["span"] == (1, 5, None) and back["pair"] == (1, "a")
    assert back["colour"] == "red" and back["kind"] == 3 and back["scalar"] == 1.5
    assert np.array_equal(back["array"], np.arange(3, dtype=np.int16))


def test_a_payload_without_conversions_is_the_same_object() -> None:
    tensor = torch.ones(3)
    assert to_wire(tensor) is tensor
    assert to_wire(b"packed kv") == b"packed kv"
    assert from_wire({"a": 1}) == {"a": 1}


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vLLM-Omni is installed here")
def test_the_bridge_names_what_to_install_when_vllm_omni_is_missing() -> None:
    code = (
        "import omni_plugins\n"
        "try:\n"
        "    omni_plugins.create_connector('vllm-omni', {'connector': 'SharedMemoryConnector'})\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("PluginLoadError")
    assert "pip install 'omni-plugins-vllm-omni[vllm-omni]'" in out
