"""After a run: does any backend still hold something? (shm segments, Redis keys, store objects, staged payloads)

Each check knows one connector by its canonical name and returns messages
describing what is left (empty: clean). Stage processes report their own
connector's ``health()``; :func:`health_leaks` reads the per-process fields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from omni_plugins.config.models import PipelineConfig

logger = logging.getLogger(__name__)

#: ``health()`` fields that count payloads a connector still holds
HELD_FIELDS = ("staged", "being_read")


def _shm(instance: str, config: Any, run_tag: str | None) -> list[str]:
    from omni_plugins_shm.testing import namespace_segments  # type: ignore[import-not-found]

    left = namespace_segments(config.namespace, config.shm_dir)
    return [f"connector {instance!r}: {len(left)} shm file(s) left in {config.shm_dir}: {left[:5]}"] if left else []


def _redis_client(instance: str, config: Any, what: str) -> Any:
    """A plain redis-py client for the connector's server, or None where it would not reach it (cluster/Sentinel/TLS/unix socket)."""
    import redis

    if config.cluster or config.tls or config.unix_socket or getattr(config, "sentinels", None) or getattr(config, "credential_provider", None):
        logger.info("redis %s skipped for %s (cluster/Sentinel/TLS/unix socket/credential provider)", what, instance)
        return None
    password = config.password.get_secret_value() if config.password is not None else None
    if config.url:
        return redis.Redis.from_url(config.url, password=password, username=config.username, socket_timeout=10)
    return redis.Redis(host=config.host, port=config.port, db=config.db, username=config.username, password=password, socket_timeout=10)


def _redis(instance: str, config: Any, run_tag: str | None) -> list[str]:
    client = _redis_client(instance, config, "leak check")
    if client is None:
        return []
    try:
        keys = list(client.scan_iter(match=f"{config.key_prefix}*", count=1000))
    finally:
        client.close()
    return [f"connector {instance!r}: {len(keys)} Redis key(s) left under {config.key_prefix!r}: {keys[:5]}"] if keys else []


def _mooncake_store(instance: str, config: Any, run_tag: str | None) -> list[str]:
    """This run's objects still in the store; removed, as the store cannot count keys by pattern without removing them.

    Only keys of this run's requests (``req-<run_tag>-...``) are touched: a master is often shared,
    and every other object on it belongs to someone else. Without a run tag there is nothing to match.
    """
    if run_tag is None:
        return []
    from mooncake.store import MooncakeDistributedStore

    probe = MooncakeDistributedStore()
    rc = probe.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", config.master_address)
    if rc != 0:
        return [f"connector {instance!r}: cannot reach mooncake_master at {config.master_address} to check for leftovers"]
    try:
        count = int(probe.remove_by_regex(f"^{run_id_prefix(run_tag)}.*", True))
    finally:
        probe.close()
    if count < 0:
        return [f"connector {instance!r}: leak check failed: mooncake_master at {config.master_address} answered {count}"]
    return [f"connector {instance!r}: {count} store object(s) of this run left on {config.master_address} (removed)"] if count > 0 else []


def run_id_prefix(run_tag: str) -> str:
    """How every request id of the run ``run_tag`` starts, and so every backend key of its payloads
    (the runtime's and the KV manager's keys start with the request id): ``req-<run_tag>-``."""
    if not run_tag.isalnum():  # the launcher's tags are hex; anything else could widen a key pattern built from it
        raise ValueError(f"run tag must be alphanumeric, got {run_tag!r}")
    return f"req-{run_tag}-"


#: per canonical connector name: what the backend still holds (``run_tag``: this run's id, where a check is scoped to it)
CHECKS: dict[str, Callable[[str, Any, str | None], list[str]]] = {"shm": _shm, "redis": _redis, "mooncake-store": _mooncake_store}


def backend_leaks(config: PipelineConfig, used: set[str], run_tag: str | None = None) -> list[str]:
    """Leftovers in the backends of the connector instances in ``used`` (call after every stage process exited).

    shm and Redis report everything in the connector's namespace / key prefix; the Mooncake store
    reports (and removes) only the objects of the run ``run_tag``.
    """
    return _per_connector(config, used, CHECKS, run_tag, "leak check")


def _shm_reclaim(instance: str, config: Any, run_tag: str) -> list[str]:
    from omni_plugins_shm import gc  # type: ignore[import-not-found]

    # every stage process has exited: gc removes exactly the files of dead owners in the namespace
    report = gc.collect(config.namespace, shm_dir=config.shm_dir)
    return [f"connector {instance!r}: removed {len(report.removed)} shm file(s) of stopped stages"] if report.removed else []


def _redis_reclaim(instance: str, config: Any, run_tag: str) -> list[str]:
    client = _redis_client(instance, config, "reclaim")
    if client is None:
        return []
    # only this run's keys: every key of a payload is <prefix>{<key>}..., and this run's keys start with its request ids
    pattern = f"{_glob_escape(config.key_prefix)}{{{run_id_prefix(run_tag)}*"
    removed = 0
    try:
        batch: list[Any] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                removed += int(client.delete(*batch))
                batch = []
        if batch:
            removed += int(client.delete(*batch))
    finally:
        client.close()
    return [f"connector {instance!r}: deleted {removed} Redis key(s) of this run"] if removed else []


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


#: per canonical connector name: remove what a run left (only what is provably this run's or a dead process's)
RECLAIMS: dict[str, Callable[[str, Any, str], list[str]]] = {"shm": _shm_reclaim, "redis": _redis_reclaim}


def reclaim(config: PipelineConfig, used: set[str], run_tag: str) -> list[str]:
    """After a run that left something (a stage killed, a run interrupted): free it, so nothing stays behind.

    Returns one line per connector instance that had something removed. Call after every stage
    process exited. The Mooncake store's leftovers of this run were already removed by its leak
    check (:func:`backend_leaks`), which cannot count them otherwise.
    """
    return _per_connector(config, used, RECLAIMS, run_tag, "reclaim")


def _per_connector(
    config: PipelineConfig, used: set[str], steps: Mapping[str, Callable[..., list[str]]], run_tag: str | None, what: str
) -> list[str]:
    """Run the step for each used connector instance's backend (by canonical name); a failing step is one line."""
    from omni_plugins.factory import resolve_connector, validate_connector_config

    out: list[str] = []
    for instance in sorted(used):
        conn = config.connectors[instance]
        step = steps.get(resolve_connector(conn.name).name)
        if step is None:
            continue
        try:
            out += step(instance, validate_connector_config(conn.name, conn.extra), run_tag)
        except Exception as exc:
            out.append(f"connector {instance!r}: {what} failed: {type(exc).__name__}: {exc}")
    return out


def health_leaks(where: str, health: dict[str, Any]) -> list[str]:
    """Payloads a stage process's connector still held before closing, from its ``health()``."""
    out = []
    for key in HELD_FIELDS:
        value = health.get(key)
        if isinstance(value, int) and value > 0:
            out.append(f"{where}: connector still holds {value} {key} payload(s)")
    return out
