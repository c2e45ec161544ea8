"""Entry point (group ``omni_plugins``): registers the ``shm`` connector and the ``omni-plugins shm`` command.

Imports nothing heavy: import strings only.
"""

from __future__ import annotations

from omni_plugins import CommandSink, RegistrationSink, hookimpl


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        "shm",
        connector="omni_plugins_shm.connector:ShmConnector",
        config="omni_plugins_shm.config:ShmConfig",
        aliases=["SharedMemoryConnector"],
        description="POSIX shared memory on one machine, many processes, no server (pooled segments, zero-copy views)",
        services="omni_plugins_shm.services:ShmServices",
    )
    registry.register_vllm_omni(
        "SharedMemoryConnector",
        connector="shm",
        unused={"shm_threshold_bytes": "every payload goes through shared memory; small ones through the slot table (slot_bytes)"},
        description="vLLM-Omni's shared-memory connector: the shm plugin",
    )


@hookimpl
def omni_register_commands(commands: CommandSink) -> None:
    commands.register("shm", main="omni_plugins_shm.cli:main", help="shared-memory maintenance: 'shm gc' frees segments of crashed processes")
