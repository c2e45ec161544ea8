"""``--start-servers``: the private servers a pipeline's backends need, for one run.

A pipeline file takes server addresses from variables such as ``${OMNI_REDIS_URL:-...}``.
Each plugin names its variables (``server_variables`` of its services, with stand-in values) and
starts its own server (``start_server``). :class:`PrivateServers` reads the file with the
stand-ins to learn which connectors it uses, starts one server per backend that has one, sets
the variables to reach them, and stops the servers (by pid) when the run ends.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omni_plugins.errors import ConfigError
from omni_plugins.services import PrivateServer, ServiceUnavailable, offered, registered_services, services_for

logger = logging.getLogger(__name__)


def placeholders() -> dict[str, str]:
    """Every installed plugin's server variables with their stand-in values."""
    out: dict[str, str] = {}
    for services in registered_services().values():
        out.update(services.server_variables)
    return out


def connector_names(path: str | Path, *, platform: str | None = None) -> set[str]:
    """Registered names of the connectors a pipeline file uses (nothing is started or contacted).

    The plugins' server variables need no value yet: the servers that will provide them are
    chosen from this answer.
    """
    from omni_plugins.config import load_pipeline_config
    from omni_plugins.factory import resolve_connector

    env = {**placeholders(), **os.environ}
    config = load_pipeline_config(path, env=env, check_plugins=False, check_builders=False, platform=platform)
    names = set()
    for conn in config.connectors.values():
        try:
            names.add(resolve_connector(conn.name).name)
        except Exception:
            names.add(conn.name)
    return names


class PrivateServers:
    """Servers started for one run; a context manager stopping them and restoring the environment on exit."""

    def __init__(self) -> None:
        self.servers: dict[str, PrivateServer] = {}
        self._saved: dict[str, str | None] = {}
        self.descriptions: list[str] = []

    def start_for(self, names: set[str]) -> PrivateServers:
        """Start the server of every connector in ``names`` whose plugin offers one (each backend once)."""
        try:
            for name in sorted(names):
                try:
                    services = services_for(name)
                except Exception:
                    continue  # not registered: loading the pipeline reports it
                if services is None or "start_server" not in offered(services) or name in self.servers:
                    continue
                try:
                    server = services.start_server()
                except ServiceUnavailable as exc:
                    raise ConfigError(f"--start-servers: the {name!r} server cannot start: {exc}") from None
                self.servers[name] = server
                self.descriptions.append(f"{name} server pid {server.pid} at {server.address}")
                if "server_environment" in offered(services):
                    for var, value in services.server_environment(server).items():
                        self._set(var, value)
        except BaseException:
            self.stop()
            raise
        return self

    def _set(self, var: str, value: str) -> None:
        self._saved.setdefault(var, os.environ.get(var))
        os.environ[var] = value

    def stop(self) -> None:
        for name, server in reversed(list(self.servers.items())):
            try:
                server.stop()
            except Exception:
                logger.warning("stopping the %s server failed", name, exc_info=True)
        self.servers.clear()
        for var, value in self._saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        self._saved.clear()

    def __enter__(self) -> PrivateServers:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
