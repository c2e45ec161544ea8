"""Isolated plugin managers for tests."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from omni_plugins.plugins import PluginManager, PluginStatus, get_plugin_manager, set_plugin_manager

_counter = itertools.count()


@contextlib.contextmanager
def isolated_plugin_manager(*, autoload: bool = False, builtins: bool = True) -> Iterator[PluginManager]:
    """Swap the process-wide plugin manager for a fresh one (entry points not loaded unless ``autoload``)."""
    manager = PluginManager(autoload=autoload, builtins=builtins)
    manager.load()
    previous = set_plugin_manager(manager)
    try:
        yield manager
    finally:
        set_plugin_manager(previous)


@contextlib.contextmanager
def register_plugin(plugin: object, *, name: str | None = None, manager: PluginManager | None = None) -> Iterator[PluginStatus]:
    """Register ``plugin`` (an object or module with hookimpls) until the block ends."""
    target = manager or get_plugin_manager()
    plugin_name = name or f"test-plugin-{next(_counter)}"
    status = target.register(plugin, name=plugin_name, distribution="(test)")
    try:
        yield status
    finally:
        target.unregister(plugin_name)
