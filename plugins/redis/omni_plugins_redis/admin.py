"""A plain redis-py client for the services: the same server (or cluster) and credentials as the connector's config.

Not the connector's data path: one connection at a time, for scans, deletes and the raw baseline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from redis.cluster import ClusterNode, RedisCluster

if TYPE_CHECKING:
    from omni_plugins_redis.config import RedisConfig

TIMEOUT_S = 30.0


def plain_client(config: RedisConfig, *, timeout: float = TIMEOUT_S) -> redis.Redis | RedisCluster:
    """A redis-py client reaching what ``config`` reaches: one server, a cluster (every primary), Sentinel's primary,
    TLS, ACL or a credential provider, unix socket."""
    from omni_plugins_redis.topology import auth_and_timeouts, sentinel_for, tls_options

    params = auth_and_timeouts(config)
    params.update(socket_timeout=timeout)
    params.pop("retry")  # redis-py's own retries for these one-off commands
    if config.tls:
        params.update(ssl=True, **tls_options(config))
    if config.cluster:
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in config.nodes()], **params)
    if config.sentinels:
        params.pop("ssl", None)
        return sentinel_for(config).master_for(config.service_name or "", db=config.db, ssl=config.tls, **params)
    if config.unix_socket:
        return redis.Redis(unix_socket_path=config.unix_socket, db=config.db, **params)
    return redis.Redis(host=config.host, port=config.port, db=config.db, **params)


def glob_escape(text: str) -> str:
    """``text`` matched literally inside a ``SCAN MATCH`` pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan(client: redis.Redis | RedisCluster, pattern: str) -> list[bytes]:
    """Every key matching ``pattern`` (on every primary of a cluster)."""
    return list(client.scan_iter(match=pattern, count=1000))


def delete_matching(client: redis.Redis | RedisCluster, pattern: str, batch: int = 500) -> int:
    """Delete every key matching ``pattern``; how many were deleted."""
    removed = 0
    keys = scan(client, pattern)
    for i in range(0, len(keys), batch):
        removed += int(client.delete(*keys[i : i + batch]))
    return removed
