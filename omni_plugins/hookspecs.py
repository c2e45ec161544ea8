"""Pluggy hook specifications: the doors through which plugins add connectors (and their services) and commands.

A plugin module (named by an entry point in the ``omni_plugins`` group) defines::

    from omni_plugins import CommandSink, RegistrationSink, hookimpl

    @hookimpl
    def omni_register_connectors(registry: RegistrationSink) -> None:
        registry.register("mybackend", connector="my_pkg.connector:MyConnector",
                          config="my_pkg.config:MyConfig", aliases=["MyConnector"],
                          services="my_pkg.services:MyServices")

    @hookimpl
    def omni_register_commands(commands: CommandSink) -> None:
        commands.register("mybackend", main="my_pkg.cli:main", help="maintenance of mybackend")

Import strings keep heavy dependencies unimported until a connector is created, a service is
asked for or a command runs. Every hook is optional, but a plugin implements at least one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from omni_plugins.commands import CommandSink
    from omni_plugins.registry import RegistrationSink

PROJECT_NAME = "omni_plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def omni_register_connectors(registry: RegistrationSink) -> None:
    """Register connectors by calling ``registry.register(name, connector=..., config=..., services=...)``.

    ``services`` names the connector's :class:`omni_plugins.services.ConnectorServices` (leak census,
    reclaim, private server, raw baseline, preload modules).
    """


@hookspec
def omni_register_commands(commands: CommandSink) -> None:
    """Add subcommands to the ``omni-plugins`` CLI by calling ``commands.register(name, main=..., help=...)``."""
