"""Pluggy hook specifications: the one door through which plugins add connectors.

A plugin module (named by an entry point in the ``omni_plugins`` group) defines::

    from omni_plugins import hookimpl

    @hookimpl
    def omni_register_connectors(registry):
        registry.register("mybackend", connector="my_pkg.connector:MyConnector",
                          config="my_pkg.config:MyConfig", aliases=["MyConnector"])

Import strings keep heavy dependencies unimported until a connector is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from omni_plugins.registry import RegistrationSink

PROJECT_NAME = "omni_plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def omni_register_connectors(registry: RegistrationSink) -> None:
    """Register connectors by calling ``registry.register(name, connector=..., config=...)``."""
