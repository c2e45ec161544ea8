"""Built-in plugin: the core registers its own reference connector through the same hook as everyone else."""

from __future__ import annotations

from omni_plugins.hookspecs import hookimpl
from omni_plugins.registry import RegistrationSink


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        "memory",
        connector="omni_plugins.memory:MemoryConnector",
        config="omni_plugins.memory:MemoryConfig",
        aliases=["InProcessConnector"],
        description="in-process reference connector (tests, single-process pipelines)",
        services="omni_plugins.memory_services:MemoryServices",
    )
