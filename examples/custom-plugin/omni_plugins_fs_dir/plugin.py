"""Entry point (group ``omni_plugins``): registers the 'fs-dir' connector.

Only import strings here: the connector module is imported when a connector is created.
"""

from __future__ import annotations

from typing import Any

from omni_plugins import hookimpl


@hookimpl
def omni_register_connectors(registry: Any) -> None:
    registry.register(
        "fs-dir",
        connector="omni_plugins_fs_dir.connector:FsDirConnector",
        config="omni_plugins_fs_dir.config:FsDirConfig",
        aliases=["FsDirConnector"],
        description="payloads as files in a directory (atomic rename)",
    )
