"""Every hook and every service is documented, and a test plugin exercises each one (datasette's rule).

``tests/plugins/served`` implements every hook and offers every service; the services kit runs
against it here, its command runs through the CLI. ``docs/plugins/services.md`` has a section per
hook, service and pytest fixture.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_plugins import hookspecs
from omni_plugins.plugins import PluginManager
from omni_plugins.services import SERVICE_ATTRIBUTES, SERVICE_METHODS, offered, services_for
from omni_plugins.testing import ServicesContract, register_plugin
from omni_plugins.testing.pytest_plugin import ServerFactory

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugins" / "services.md"
HOOKS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("omni_"))
FIXTURES = ("omni_plugin_manager", "omni_connector", "omni_server")


@pytest.fixture
def served(omni_plugin_manager: PluginManager, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The test plugin, registered on this test's plugin manager."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins" / "served"))
    plugin = importlib.import_module("omni_test_served.plugin")
    with register_plugin(plugin, name="served", manager=omni_plugin_manager) as status:
        assert status.status == "loaded", status.error
        yield plugin


def _documented() -> set[str]:
    return set(re.findall(r"^#+ `([a-z_]+)`", DOC.read_text(encoding="utf-8"), re.M))


@pytest.mark.parametrize("name", [*HOOKS, *SERVICE_METHODS, *SERVICE_ATTRIBUTES, *FIXTURES])
def test_documented(name: str) -> None:
    assert name in _documented(), f"docs/plugins/services.md has no section '### `{name}`'"


def test_nothing_documented_that_does_not_exist() -> None:
    assert _documented() <= {*HOOKS, *SERVICE_METHODS, *SERVICE_ATTRIBUTES, *FIXTURES}


def test_the_test_plugin_implements_every_hook_and_offers_every_service(served: Any, omni_plugin_manager: PluginManager) -> None:
    implemented = {impl.function.__name__ for hook in HOOKS for impl in getattr(omni_plugin_manager.pm.hook, hook).get_hookimpls()}
    assert set(HOOKS) <= implemented
    services = services_for("served-dir")
    assert services is not None and set(offered(services)) == {*SERVICE_METHODS, *SERVICE_ATTRIBUTES}


def test_the_command_hook_adds_a_subcommand(served: Any, omni_server: ServerFactory, capsys: pytest.CaptureFixture[str]) -> None:
    from omni_plugins.cli import main

    server = omni_server("served-dir")
    assert main(["served-where", "--address", server.address]) == 0
    directory = capsys.readouterr().out.strip()
    assert Path(directory).is_dir() and directory == getattr(server, "directory", None)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "served-where" in capsys.readouterr().out


class TestServedServices(ServicesContract):
    """Every service of the test plugin through the kit: census, reclaim, server, environment, bench config, baseline, preload."""

    leftover = "open"  # registered in this process only: a child process would not find it

    @pytest.fixture
    def connector_spec(self, served: Any, omni_server: ServerFactory) -> tuple[str, dict[str, Any]]:
        return "served-dir", omni_server("served-dir").connector_config()
