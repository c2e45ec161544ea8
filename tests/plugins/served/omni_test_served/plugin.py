"""A test plugin that implements every hook and offers every service.

Its connector ``served-dir`` keeps payloads as files in a directory that only its server knows:
the connector asks the server (``address``) for it. So a pipeline over it runs only when its
server was started (``omni-plugins run --start-servers``), and a test sees the server started and stopped.
"""

from __future__ import annotations

from omni_plugins import CommandSink, RegistrationSink, hookimpl


@hookimpl
def omni_register_connectors(registry: RegistrationSink) -> None:
    registry.register(
        "served-dir",
        connector="omni_test_served.connector:ServedDirConnector",
        config="omni_test_served.connector:ServedDirConfig",
        services="omni_test_served.services:ServedDirServices",
        description="test fixture: files in the directory its server names",
    )


@hookimpl
def omni_register_commands(commands: CommandSink) -> None:
    commands.register("served-where", main="omni_test_served.cli:main", help="print the directory a served-dir server names")
