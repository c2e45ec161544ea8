"""``put_many`` over Redis: one encode, one write per server, every key its own payload, a refused key failing alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from omni_plugins_redis import connector as connector_mod
from omni_plugins_redis.client import Link
from omni_plugins_redis.connector import acl_rule
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.testing import RedisCluster, RedisServer

from omni_plugins import create_connector

PREFIX = "omnitest:"
FAN_PREFIX = "omnifan:"
ADMIN_PW = "admin-Secret-1"
APP_PW = "app-Secret-2"


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the connector encodes a payload and writes to a connection (each write: one system call or so)."""
    seen = {"encodes": 0, "writes": 0}
    real_encode, real_send = connector_mod.wire.encode, Link.send_frames

    def encode(data: Any) -> Any:
        seen["encodes"] += 1
        return real_encode(data)

    def send_frames(self: Link, frames: Any) -> None:
        seen["writes"] += 1
        real_send(self, frames)

    monkeypatch.setattr(connector_mod.wire, "encode", encode)
    monkeypatch.setattr(Link, "send_frames", send_frames)
    return seen


def _targets(keys: list[str]) -> list[tuple[int, int, str]]:
    return [(0, i + 1, k) for i, k in enumerate(keys)]


def test_one_encode_and_one_write_for_every_key(redis_server: RedisServer, server_config: dict[str, Any], counts: dict[str, int]) -> None:
    keys = [f"fan-{i}" for i in range(4)]
    payload = {"hidden": torch.randn(2, 512), "ids": [1, 2, 3]}
    with create_connector("redis", server_config) as conn:
        assert conn.put(0, 1, "warm", {"v": 0}).ok and conn.get(0, 1, "warm") is not None  # the connection is open
        counts.update(encodes=0, writes=0)
        results = conn.put_many(_targets(keys), payload)
        assert all(r.ok for r in results) and len({r.size for r in results}) == 1
        assert counts == {"encodes": 1, "writes": 1}
        for i, key in enumerate(keys):
            got = conn.get(0, i + 1, key)
            assert got is not None and torch.equal(got.data["hidden"], payload["hidden"]) and got.data["ids"] == [1, 2, 3]
        counts.update(encodes=0, writes=0)
        for key in keys:  # the same fan-out as puts, for comparison
            assert conn.put(0, 1, key, payload).ok
        assert counts == {"encodes": 4, "writes": 4}
        for key in keys:
            assert conn.cleanup(key)
    assert redis_server.keys(PREFIX + "*") == []


def test_parted_payload_under_every_key(redis_server: RedisServer, server_config: dict[str, Any], counts: dict[str, int]) -> None:
    """A payload cut into parts: each key gets its own parts and manifest, all from one encoding."""
    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: 19 parts of 64 KiB
    keys = [f"parted-{i}" for i in range(3)]
    with create_connector("redis", {**server_config, "chunk_bytes": 64 * 1024}) as conn:
        results = conn.put_many(_targets(keys), {"v": big})
        assert all(r.ok and r.metadata == {"parts": 19} for r in results)
        assert counts["encodes"] == 1
        big.fill_(-1.0)  # the keys hold what was there at put_many
        for i, key in enumerate(keys):
            got = conn.get(0, i + 1, key, timeout=5)
            assert got is not None and torch.equal(got.data["v"], torch.arange(300_000, dtype=torch.float32))
    assert redis_server.keys(PREFIX + "*") == []


def test_cluster_keys_go_one_write_per_node(redis_cluster: RedisCluster, cluster_config: dict[str, Any], counts: dict[str, int]) -> None:
    """Keys hash to slots on different nodes: one write per node holding some, every key delivered."""
    keys = [f"spread-{i}" for i in range(12)]
    nodes = {redis_cluster.primary_of(PayloadKeys(PREFIX, k).slot).port for k in keys}
    assert len(nodes) > 1
    with create_connector("redis", cluster_config) as conn:
        for key in keys:  # one connection per node open, the slot map known
            assert conn.put(0, 1, key, {"v": 0}).ok and conn.get(0, 1, key) is not None
        counts.update(encodes=0, writes=0)
        results = conn.put_many(_targets(keys), {"v": torch.arange(10)})
        assert all(r.ok for r in results)
        assert counts == {"encodes": 1, "writes": len(nodes)}
        for i, key in enumerate(keys):
            got = conn.get(0, i + 1, key)
            assert got is not None and torch.equal(got.data["v"], torch.arange(10))
    assert redis_cluster.keys(PREFIX + "*") == []


@pytest.fixture(scope="module")
def partial_acl_server(track_server: Any) -> Iterator[RedisServer]:
    """A user whose key pattern covers only keys starting with ``ok`` under the prefix."""
    with RedisServer(password=ADMIN_PW, acl_users=[f"fan on >{APP_PW} {acl_rule(FAN_PREFIX + '{ok')}"]) as server:
        track_server(server)
        yield server
        assert server.keys(FAN_PREFIX + "*") == []


@pytest.mark.parametrize("size", [100, 300_000], ids=["inline", "parted"])
def test_a_refused_key_fails_alone_and_leaves_nothing(partial_acl_server: RedisServer, size: int) -> None:
    config = {"url": partial_acl_server.url, "username": "fan", "password": APP_PW, "key_prefix": FAN_PREFIX, "chunk_bytes": 64 * 1024}
    payload = {"v": torch.ones(size)}
    with create_connector("redis", config) as conn:
        first, refused, last = conn.put_many(_targets(["ok-a", "no-b", "ok-c"]), payload)
        assert first.ok and last.ok
        assert not refused.ok and "'no-b'" in refused.metadata["error"] and "NOPERM" in refused.metadata["error"].upper()
        for stage, key in ((1, "ok-a"), (3, "ok-c")):
            got = conn.get(0, stage, key, timeout=5)
            assert got is not None and torch.equal(got.data["v"], payload["v"])
    assert partial_acl_server.keys(FAN_PREFIX + "*") == []
