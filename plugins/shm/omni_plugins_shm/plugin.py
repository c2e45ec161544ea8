"""Entry point (group ``omni_plugins``): registers the ``shm`` connector. Imports nothing heavy."""

from __future__ import annotations

from typing import Any

from omni_plugins import hookimpl


@hookimpl
def omni_register_connectors(registry: Any) -> None:
    registry.register(
        "shm",
        connector="omni_plugins_shm.connector:ShmConnector",
        config="omni_plugins_shm.config:ShmConfig",
        aliases=["SharedMemoryConnector"],
        description="POSIX shared memory on one machine, many processes, no server (pooled segments, zero-copy views)",
        services="omni_plugins_shm.services:ShmServices",
    )
