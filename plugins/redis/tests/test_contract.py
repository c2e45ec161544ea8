"""The core conformance suite against a standalone server, a 3-master cluster and a primary behind Sentinel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from omni_plugins.testing import ConnectorContract


class TestStandaloneContract(ConnectorContract):
    cross_process = True
    bad_config = {"chunk_bytes": 10}

    @pytest.fixture
    def connector_spec(self, server_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "redis", server_config


class TestClusterContract(ConnectorContract):
    cross_process = True
    bad_config = {"cluster": True, "unix_socket": "/tmp/x.sock"}

    @pytest.fixture
    def connector_spec(self, cluster_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "redis", cluster_config


@pytest.fixture(scope="module")
def sentinel_config(track_server: Any) -> Iterator[dict[str, Any]]:
    from omni_plugins_redis.testing import RedisSentinelGroup

    with RedisSentinelGroup(replicas=1, sentinels=1) as group:
        for node in [*group.data_nodes, *group.sentinels]:
            track_server(node)
        yield group.connector_config(key_prefix="omnitest:")
        assert group.keys("omnitest:*") == [], "keys left behind behind Sentinel"


class TestSentinelContract(ConnectorContract):
    cross_process = True
    bad_config = {"sentinels": ["127.0.0.1:1"]}  # no service_name

    @pytest.fixture
    def connector_spec(self, sentinel_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "redis", sentinel_config
