"""Entry point (group ``omni_plugins``): registers the ``redis`` connector.

Only import strings are registered; redis-py and torch are imported when the
connector is created.
"""

from __future__ import annotations

from omni_plugins import RegistrationSink, hookimpl


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        "redis",
        connector="omni_plugins_redis.connector:RedisConnector",
        config="omni_plugins_redis.config:RedisConfig",
        aliases=["RedisConnector", "RedisClusterConnector"],
        description="Redis / Redis Cluster / Sentinel: cross-host payloads, chunked pipelined writes, blocking get via BLMOVE, replica-acknowledged puts",
        services="omni_plugins_redis.services:RedisServices",
    )
