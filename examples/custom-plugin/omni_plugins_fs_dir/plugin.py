"""Entry point (group ``omni_plugins``): registers the 'fs-dir' connector and its services.

Only import strings here: the connector module is imported when a connector is created, the
services module when a service is asked for (``omni-plugins run``'s leak checks, ``omni-plugins bench``).
"""

from __future__ import annotations

from omni_plugins import RegistrationSink, hookimpl


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        "fs-dir",
        connector="omni_plugins_fs_dir.connector:FsDirConnector",
        config="omni_plugins_fs_dir.config:FsDirConfig",
        services="omni_plugins_fs_dir.services:FsDirServices",
        aliases=["FsDirConnector"],
        description="payloads as files in a directory (atomic rename)",
    )
