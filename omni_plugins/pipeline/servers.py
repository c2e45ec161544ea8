"""``--start-servers``: private redis-server / mooncake_master on free loopback ports for one run.

Examples take server addresses from ``${OMNI_REDIS_URL:-...}`` and
``${OMNI_MOONCAKE_MASTER:-...}``. :class:`PrivateServers` starts the servers a
pipeline needs with the plugins' own test launchers
(:mod:`omni_plugins_redis.testing`, :mod:`omni_plugins_mooncake.testing`),
sets those variables, and stops the servers (by pid) when the run ends.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Any

from omni_plugins.errors import ConfigError

logger = logging.getLogger(__name__)

REDIS_ENV = "OMNI_REDIS_URL"
MOONCAKE_ENV = "OMNI_MOONCAKE_MASTER"

#: canonical connector name -> the server kind it needs
SERVER_OF = {"redis": "redis", "mooncake-store": "mooncake"}

#: stand-ins for the variables --start-servers sets, so a file using them without a default loads before any server runs
PLACEHOLDERS = {REDIS_ENV: "redis://127.0.0.1:6379/0", MOONCAKE_ENV: "127.0.0.1:50051"}


def connector_names(path: str | Path) -> set[str]:
    """Canonical names of the connectors a pipeline file uses (nothing is started or contacted).

    ``${OMNI_REDIS_URL}`` / ``${OMNI_MOONCAKE_MASTER}`` need no value yet: the servers
    that will provide them are chosen from this answer.
    """
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.factory import resolve_connector

    env = {**PLACEHOLDERS, **os.environ}
    config = load_pipeline_config(path, env=env, check_plugins=False, check_builders=False)
    names = set()
    for conn in config.connectors.values():
        try:
            names.add(resolve_connector(conn.name).name)
        except Exception:
            names.add(conn.name)
    return names


class PrivateServers:
    """Servers started for one run; a context manager restoring the environment on exit."""

    def __init__(self) -> None:
        self._servers: list[Any] = []
        self._saved: dict[str, str | None] = {}
        self.descriptions: list[str] = []

    def start_for(self, names: set[str]) -> PrivateServers:
        kinds = {SERVER_OF[n] for n in names if n in SERVER_OF}
        try:
            if "redis" in kinds:
                self._start_redis()
            if "mooncake" in kinds:
                self._start_mooncake()
        except BaseException:
            self.stop()
            raise
        return self

    def _set(self, var: str, value: str) -> None:
        self._saved.setdefault(var, os.environ.get(var))
        os.environ[var] = value

    def _start_redis(self) -> None:
        try:
            from omni_plugins_redis.testing import RedisServer  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError("--start-servers: the redis plugin is not installed: pip install omni-plugins-redis") from None
        password = secrets.token_hex(16)
        server = RedisServer(password=password)
        try:
            server.start()
        except FileNotFoundError:
            raise ConfigError("--start-servers: redis-server not found; install it (Debian: apt-get install redis-server)") from None
        self._servers.append(server)
        self._set(REDIS_ENV, f"redis://:{password}@127.0.0.1:{server.port}/0")
        self.descriptions.append(f"redis-server pid {server.process.pid if server.process else '?'} at {server.url} (password set)")

    def _start_mooncake(self) -> None:
        try:
            from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment  # type: ignore[import-not-found]
        except ImportError:
            raise ConfigError("--start-servers: the mooncake plugin is not installed: pip install 'omni-plugins-mooncake[cpu]'") from None
        loopback_environment()
        try:
            master = MooncakeMaster().start()
        except RuntimeError as exc:
            raise ConfigError(f"--start-servers: {exc}") from None
        self._servers.append(master)
        self._set(MOONCAKE_ENV, master.address)
        self.descriptions.append(f"mooncake_master pid {master.pid} at {master.address}")

    def stop(self) -> None:
        for server in reversed(self._servers):
            try:
                server.stop()
            except Exception:
                logger.warning("stopping %s failed", server, exc_info=True)
        self._servers.clear()
        for var, value in self._saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        self._saved.clear()

    def __enter__(self) -> PrivateServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
