"""The pytest plugin of omni-plugins (entry point ``pytest11``): fixtures a plugin's own tests use.

Installed with the core, so any plugin's tests run from its own folder with plain ``pytest``:

- ``omni_plugin_manager``: an isolated plugin manager for the test (entry points not loaded,
  built-ins on); register test plugins on it with :func:`omni_plugins.testing.register_plugin`.
- ``omni_connector``: ``omni_connector(name, config)`` creates a connector that is closed after
  the test, whatever happens in it.
- ``omni_server``: ``omni_server(name)`` is the private server of connector ``name``'s plugin
  (its ``start_server`` service), started on first use, one per connector for the session,
  stopped by pid at the end (and checked gone).

The conformance kits, :class:`omni_plugins.testing.ConnectorContract` and
:class:`omni_plugins.testing.ServicesContract`, use them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from omni_plugins.contract import Connector
    from omni_plugins.plugins import PluginManager
    from omni_plugins.services import PrivateServer

ConnectorFactory = Callable[..., "Connector"]
ServerFactory = Callable[[str], "PrivateServer"]


@pytest.fixture
def omni_plugin_manager() -> Iterator[PluginManager]:
    """A fresh process-wide plugin manager for this test (only built-ins and what the test registers); the previous one after."""
    from omni_plugins.testing.isolation import isolated_plugin_manager

    with isolated_plugin_manager() as manager:
        yield manager


@pytest.fixture
def omni_connector() -> Iterator[ConnectorFactory]:
    """``omni_connector(name, config=None)``: a connector built from its config, closed after the test (close errors fail it)."""
    from omni_plugins.factory import create_connector

    made: list[Connector] = []

    def make(name: str, config: Mapping[str, Any] | None = None) -> Connector:
        connector = create_connector(name, dict(config or {}))
        made.append(connector)
        return connector

    yield make
    failures = []
    for connector in reversed(made):
        try:
            connector.close()
        except Exception as exc:
            failures.append(f"{connector.name}: {type(exc).__name__}: {exc}")
    if failures:
        pytest.fail("closing connectors failed: " + "; ".join(failures))


@pytest.fixture(scope="session")
def omni_server() -> Iterator[ServerFactory]:
    """``omni_server(name)``: connector ``name``'s private server (its plugin's ``start_server``), one per connector per session."""
    from omni_plugins.factory import resolve_connector
    from omni_plugins.services import require

    started: dict[str, PrivateServer] = {}

    def server(name: str) -> PrivateServer:
        key = resolve_connector(name).name
        if key not in started:
            started[key] = require(key, "start_server").start_server()
        return started[key]

    yield server
    alive = []
    for name, running in reversed(list(started.items())):
        pid = running.pid
        running.stop()
        if pid is not None and process_running(pid):
            alive.append(f"{name} server pid {pid}")
    assert not alive, f"private servers still running after stop(): {alive}"


def process_running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its parent does not count)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
