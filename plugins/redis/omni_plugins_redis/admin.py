"""A plain redis-py client for the services: the same server (or cluster) and credentials as the connector's config.

Not the connector's data path: one connection at a time, for scans, deletes and the raw baseline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import ClusterNode, RedisCluster

if TYPE_CHECKING:
    from omni_plugins_redis.config import RedisConfig

TIMEOUT_S = 30.0


def plain_client(config: RedisConfig, *, timeout: float = TIMEOUT_S) -> redis.Redis | RedisCluster:
    """A redis-py client reaching what ``config`` reaches: one server, a cluster (every primary), TLS, ACL, unix socket."""
    params: dict[str, Any] = {
        "username": config.username,
        "password": config.password.get_secret_value() if config.password is not None else None,
        "socket_timeout": timeout,
        "socket_connect_timeout": config.connect_timeout,
    }
    if config.tls:
        params.update(
            ssl=True,
            ssl_ca_certs=str(config.tls_ca_file) if config.tls_ca_file else None,
            ssl_certfile=str(config.tls_cert_file) if config.tls_cert_file else None,
            ssl_keyfile=str(config.tls_key_file) if config.tls_key_file else None,
            ssl_check_hostname=config.tls_check_hostname,
        )
    if config.cluster:
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in config.nodes()], **params)
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
