"""The Redis connector's services, on redis-py: leak census and reclaim, a private server, the raw baseline.

Imported only when a service is asked for (``omni-plugins run``, ``bench``, the pytest fixtures).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omni_plugins.bench.targets import SizeTarget
from omni_plugins.bench.units import KIB, MIB
from omni_plugins.services import ConnectorServices, Finding, PrivateServer, RunScope, ServiceUnavailable

if TYPE_CHECKING:
    from omni_plugins.services import RawBaseline
    from omni_plugins_redis.config import RedisConfig
    from omni_plugins_redis.testing import RedisServer

#: the variable example pipelines read the server's URL from (``${OMNI_REDIS_URL:-redis://...}``)
URL_VARIABLE = "OMNI_REDIS_URL"


class RedisServices(ConnectorServices["RedisConfig"]):
    preload = ("omni_plugins_redis.connector",)
    server_variables = {URL_VARIABLE: "redis://127.0.0.1:6379/0"}
    bench_targets = (
        SizeTarget("64 MiB put >= 5x a raw SET", "put_ratio", 5.0, min_size=64 * MIB, max_size=64 * MIB),
        SizeTarget("64 MiB get >= 2x a raw GET", "get_ratio", 2.0, min_size=64 * MIB, max_size=64 * MIB),
        SizeTarget("4 KiB put + get <= 1.2x a raw SET + GET", "cost", 1.2, min_size=4 * KIB, max_size=4 * KIB),
    )

    def census(self, config: RedisConfig, run: RunScope) -> Finding:
        """Every key under the connector's ``key_prefix`` (a prefix belongs to one pipeline)."""
        from omni_plugins_redis.admin import glob_escape, plain_client, scan

        client = plain_client(config)
        try:
            keys = scan(client, f"{glob_escape(config.key_prefix)}*")
        finally:
            client.close()
        sample = tuple(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in keys[:5])
        return Finding(len(keys), "Redis key(s)", f"under {config.key_prefix!r}", sample)

    def reclaim(self, config: RedisConfig, run: RunScope) -> Finding:
        """This run's keys only: every key of a payload is ``<prefix>{<key>}...`` and this run's keys start with its request ids."""
        from omni_plugins_redis.admin import delete_matching, glob_escape, plain_client

        client = plain_client(config)
        try:
            removed = delete_matching(client, f"{glob_escape(config.key_prefix)}{{{glob_escape(run.request_prefix)}*")
        finally:
            client.close()
        return Finding(removed, "Redis key(s) of this run")

    def start_server(self) -> PrivateServer:
        """``redis-server`` on a free loopback port, with a random password; large values allowed (the benchmark's sizes)."""
        from omni_plugins_redis.testing import RedisServer

        server = RedisServer(password=secrets.token_hex(16), extra_args=["--proto-max-bulk-len", "2gb"])
        try:
            return server.start()
        except FileNotFoundError:
            server.stop()
            raise ServiceUnavailable("redis-server not found; install it (Debian: apt-get install redis-server)") from None

    def server_environment(self, server: PrivateServer) -> Mapping[str, str]:
        redis_server = cast("RedisServer", server)
        return {URL_VARIABLE: f"redis://:{redis_server.password}@{redis_server.address}/0"}

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        prefix = f"omnibench-{uuid.uuid4().hex[:8]}:"
        return server.connector_config(key_prefix=prefix) if server is not None else {"key_prefix": prefix}

    def raw_baseline(self, config: RedisConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_redis.baseline import RedisRaw

        return RedisRaw(config)
