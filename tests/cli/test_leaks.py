"""The leak checks of ``omni-plugins run`` see real leftovers in real backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_plugins.config import load_pipeline_config
from omni_plugins.pipeline.leaks import backend_leaks, health_leaks

from .conftest import tiny_pipeline


def test_shm_leftover_segment_is_reported(tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins import create_connector

    config = load_pipeline_config(tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}"))
    assert backend_leaks(config, {"c"}) == []
    producer = create_connector("shm", {"namespace": shm_ns, "pool_bytes": 0})
    try:
        producer.put(0, 1, "never-read", {"x": list(range(10))})
        leaks = backend_leaks(config, {"c"})
        assert len(leaks) == 1 and shm_ns in leaks[0] and "shm file" in leaks[0]
        assert producer.cleanup("never-read")
    finally:
        producer.close()
    assert backend_leaks(config, {"c"}) == []


def test_redis_leftover_key_is_reported(tmp_path: Path) -> None:
    testing = pytest.importorskip("omni_plugins_redis.testing")
    with testing.RedisServer(password="pw") as server:
        url = f"redis://:pw@127.0.0.1:{server.port}/0"
        config = load_pipeline_config(tiny_pipeline(tmp_path, name="redis", extra=f'{{url: "{url}", key_prefix: "lk:"}}'))
        assert backend_leaks(config, {"c"}) == []
        client = server.client()
        client.set("lk:orphan", b"x")
        client.set("other:key", b"y")  # another prefix is not ours
        leaks = backend_leaks(config, {"c"})
        client.close()
        assert len(leaks) == 1 and "1 Redis key(s)" in leaks[0] and "lk:orphan" in leaks[0]


def test_health_fields_of_held_payloads() -> None:
    assert health_leaks("stage 0 rank 0", {"ok": True, "staged": 0}) == []
    assert health_leaks("stage 0 rank 0", {"ok": True, "staged": 2, "being_read": 1}) == [
        "stage 0 rank 0: connector still holds 2 staged payload(s)",
        "stage 0 rank 0: connector still holds 1 being_read payload(s)",
    ]
