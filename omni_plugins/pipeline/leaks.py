"""After a run: does any backend still hold something? (shm segments, Redis keys, store objects, staged payloads)

Each check knows one connector by its canonical name and returns messages
describing what is left (empty: clean). Stage processes report their own
connector's ``health()``; :func:`health_leaks` reads the per-process fields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omni_plugins.config.models import PipelineConfig

logger = logging.getLogger(__name__)

#: ``health()`` fields that count payloads a connector still holds
HELD_FIELDS = ("staged", "being_read")


def _shm(instance: str, config: Any) -> list[str]:
    from omni_plugins_shm.testing import namespace_segments  # type: ignore[import-not-found]

    left = namespace_segments(config.namespace, config.shm_dir)
    return [f"connector {instance!r}: {len(left)} shm file(s) left in {config.shm_dir}: {left[:5]}"] if left else []


def _redis(instance: str, config: Any) -> list[str]:
    import redis

    if config.cluster or config.tls or config.unix_socket:
        logger.info("redis leak check skipped for %s (cluster/TLS/unix socket)", instance)
        return []
    password = config.password.get_secret_value() if config.password is not None else None
    if config.url:
        client = redis.Redis.from_url(config.url, password=password, username=config.username, socket_timeout=10)
    else:
        client = redis.Redis(
            host=config.host, port=config.port, db=config.db, username=config.username, password=password, socket_timeout=10
        )
    try:
        keys = list(client.scan_iter(match=f"{config.key_prefix}*", count=1000))
    finally:
        client.close()
    return [f"connector {instance!r}: {len(keys)} Redis key(s) left under {config.key_prefix!r}: {keys[:5]}"] if keys else []


def _mooncake_store(instance: str, config: Any) -> list[str]:
    from mooncake.store import MooncakeDistributedStore

    probe = MooncakeDistributedStore()
    rc = probe.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", config.master_address)
    if rc != 0:
        return [f"connector {instance!r}: cannot reach mooncake_master at {config.master_address} to check for leftovers"]
    try:
        count = int(probe.remove_all(True))
    finally:
        probe.close()
    return [f"connector {instance!r}: {count} store object(s) left on {config.master_address}"] if count > 0 else []


CHECKS: dict[str, Callable[[str, Any], list[str]]] = {"shm": _shm, "redis": _redis, "mooncake-store": _mooncake_store}


def backend_leaks(config: PipelineConfig, used: set[str]) -> list[str]:
    """Leftovers in the backends of the connector instances in ``used`` (call after every stage process exited)."""
    from omni_plugins.factory import resolve_connector, validate_connector_config

    out: list[str] = []
    for instance in sorted(used):
        conn = config.connectors[instance]
        name = resolve_connector(conn.name).name
        check = CHECKS.get(name)
        if check is None:
            continue
        try:
            out += check(instance, validate_connector_config(conn.name, conn.extra))
        except Exception as exc:
            out.append(f"connector {instance!r}: leak check failed: {type(exc).__name__}: {exc}")
    return out


def health_leaks(where: str, health: dict[str, Any]) -> list[str]:
    """Payloads a stage process's connector still held before closing, from its ``health()``."""
    out = []
    for key in HELD_FIELDS:
        value = health.get(key)
        if isinstance(value, int) and value > 0:
            out.append(f"{where}: connector still holds {value} {key} payload(s)")
    return out
