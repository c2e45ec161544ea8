"""The services kit against the Redis plugin: census and reclaim, its private server, the raw baseline.

The census and reclaim reach what the connector reaches: a single server, a cluster (every
primary), a TLS-only server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from omni_plugins_redis.testing import RedisCluster, RedisServer

from omni_plugins.testing import ServicesContract


def _prefix() -> str:
    return f"svc-{uuid.uuid4().hex[:8]}:"


class TestRedisServices(ServicesContract):
    leftover = "killed"
    server_overrides = {"key_prefix": "svc-server:"}

    @pytest.fixture
    def connector_spec(self, redis_server: RedisServer) -> tuple[str, dict[str, Any]]:
        return "redis", redis_server.connector_config(key_prefix=_prefix())


class TestRedisClusterServices(ServicesContract):
    leftover = "killed"

    @pytest.fixture
    def connector_spec(self, redis_cluster: RedisCluster) -> tuple[str, dict[str, Any]]:
        return "redis", redis_cluster.connector_config(key_prefix=_prefix())


@pytest.fixture(scope="module")
def tls_server(track_server: Any) -> Iterator[RedisServer]:
    with RedisServer(password="tls-pw", tls=True) as server:
        track_server(server)
        yield server


class TestRedisTlsServices(ServicesContract):
    leftover = "killed"

    @pytest.fixture
    def connector_spec(self, tls_server: RedisServer) -> tuple[str, dict[str, Any]]:
        return "redis", tls_server.connector_config(key_prefix=_prefix())
