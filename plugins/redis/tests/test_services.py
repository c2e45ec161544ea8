"""The services kit against the Redis plugin: census and reclaim, its private server, the raw baseline."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from omni_plugins_redis.testing import RedisServer

from omni_plugins.testing import ServicesContract


class TestRedisServices(ServicesContract):
    leftover = "killed"
    server_overrides = {"key_prefix": "svc-server:"}

    @pytest.fixture
    def connector_spec(self, redis_server: RedisServer) -> tuple[str, dict[str, Any]]:
        return "redis", redis_server.connector_config(key_prefix=f"svc-{uuid.uuid4().hex[:8]}:")
