"""The Redis connector under ``StageTransferRuntime``: what the runtime sees of damaged payloads."""

from __future__ import annotations

import struct
import time
from types import SimpleNamespace
from typing import Any

import torch
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.testing import RedisServer

from omni_plugins import create_connector
from omni_plugins.config.models import StageConfig
from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime

PREFIX = "omnitest:"
_HEADER = struct.Struct("<4sB3xQII16s")


def _manifest(total: int, chunk: int, nparts: int, magic: bytes = b"ORM1") -> bytes:
    return _HEADER.pack(magic, 0, total, chunk, nparts, b"0123456789abcdef")


class _Req(SimpleNamespace):
    def __init__(self, request_id: str) -> None:
        super().__init__(request_id=request_id, external_req_id=request_id)

    def is_finished(self) -> bool:
        return False


def test_damaged_payload_fails_the_request_at_once(redis_server: RedisServer, server_config: dict[str, Any]) -> None:
    """A damaged stored payload is reported ``failed`` (not retried until ``recv_timeout_s``), a healthy one still arrives."""
    garbage = b"OMNW\x01\x00\x00\x00" + b"\xff" * 40
    crafted = {
        "bad-magic": _manifest(0, 0, 0, magic=b"XXXX"),
        "wire-garbage": _manifest(len(garbage), 0, 0) + garbage,
        "missing-part": _manifest(300_000, 64 * 1024, 5),  # a parted manifest whose parts are not there
    }
    stage = StageConfig(stage_id=1, async_chunk=True, worker_type="ar", recv_timeout_s=600.0)
    tuning = RuntimeTuning(join_timeout_s=3.0, drain_timeout_s=3.0, retry_backoff_s=0.01)
    rt = StageTransferRuntime(stage, {"name": "redis", "extra": server_config}, tuning=tuning)
    raw = redis_server.client()
    failed: set[str] = set()
    timed_out: set[str] = set()
    arrived: set[str] = set()
    try:
        for rid in [*crafted, "healthy"]:
            rt.register_chunk_recv(_Req(rid))
        for rid, element in crafted.items():
            raw.rpush(PayloadKeys(PREFIX, f"{rid}_0_0").manifest, element)
        with create_connector("redis", server_config) as producer:
            assert producer.put(0, 1, "healthy_0_0", {"embed": {"decode": torch.ones(1, 4)}}).ok
        # bounded only so a regression cannot hang the suite; the assertion is on the signal
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (failed >= set(crafted) and "healthy" in arrived):
            rt.wait_ready(0.05)
            arrived |= set(rt.recv_chunk())
            signals = rt.collect_signals()
            failed |= signals.failed
            timed_out |= signals.timed_out
        assert failed == set(crafted) and timed_out == set()
        assert "healthy" in arrived
        assert rt.debug_state().get("receiver", {}).get("errors", 0) == 0, "a damaged payload was retried as a backend error"
        for rid in [*crafted, "healthy"]:
            rt.cleanup_finished_request(rid, aborted=True)
    finally:
        rt.shutdown()
        raw.close()
    assert redis_server.keys(PREFIX + "*") == []
