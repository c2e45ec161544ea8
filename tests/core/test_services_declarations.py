"""How a plugin declares services and commands: what is refused, with a message that says what to fix."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import tomllib

from omni_plugins import hookimpl
from omni_plugins.bench import SizeTarget
from omni_plugins.errors import PluginLoadError
from omni_plugins.plugins import PluginManager
from omni_plugins.services import ConnectorServices, Finding, RunScope, ServiceUnavailable, offered, require, services_for
from omni_plugins.testing import register_plugin

ROOT = Path(__file__).resolve().parents[2]


class _Good(ConnectorServices[Any]):
    preload = ("json",)

    def census(self, config: Any, run: RunScope) -> Finding:
        return Finding(0, "thing(s)")


class _Misspelled(ConnectorServices[Any]):
    def censsus(self, config: Any, run: RunScope) -> Finding:
        return Finding(0, "thing(s)")


class _WrongArguments(ConnectorServices[Any]):
    def census(self, config: Any) -> Finding:  # type: ignore[override]
        return Finding(0, "thing(s)")


class _HalfBench(ConnectorServices[Any]):
    def raw_baseline(self, config: Any, max_bytes: int, producer: bool) -> Any:
        return None


class _EnvironmentWithoutVariables(ConnectorServices[Any]):
    def start_server(self) -> Any:
        return None

    def server_environment(self, server: Any) -> dict[str, str]:
        return {}


class _Benched(ConnectorServices[Any]):
    def bench_config(self, max_bytes: int, server: Any, scratch: Path) -> dict[str, Any]:
        return {}

    def raw_baseline(self, config: Any, max_bytes: int, producer: bool) -> Any:
        return None


class _FloorWithoutRaw(ConnectorServices[Any]):
    def floor_baseline(self, config: Any, max_bytes: int, producer: bool) -> Any:
        return None


class _TargetOfAnUnknownVariant(_Benched):
    bench_variants = {"views": {"zero_copy": True}}
    bench_targets = (SizeTarget("fast views", "ratio", 1.5, variant="view"),)


class _TargetsNotSizeTargets(_Benched):
    bench_targets = ({"measure": "ratio", "bound": 1},)  # type: ignore[assignment]


class _VariantNotAnOverlay(_Benched):
    bench_variants = {"views": "zero_copy"}  # type: ignore[dict-item]


class _BadPreload(ConnectorServices[Any]):
    preload = "json"  # type: ignore[assignment]


class _NotServices:
    pass


def _plugin(services: str) -> types.ModuleType:
    module = types.ModuleType("svc_probe_plugin")

    @hookimpl
    def omni_register_connectors(registry: Any) -> None:
        registry.register("svc-probe", connector="omni_plugins.memory:MemoryConnector", config="omni_plugins.memory:MemoryConfig", services=services)

    module.omni_register_connectors = omni_register_connectors  # type: ignore[attr-defined]
    return module


@pytest.fixture
def probe(omni_plugin_manager: PluginManager) -> Any:
    def register(cls_name: str) -> Any:
        return register_plugin(_plugin(f"{__name__}:{cls_name}"), name=f"probe-{cls_name}", manager=omni_plugin_manager)

    return register


def test_services_are_imported_on_first_use_and_shared(probe: Any) -> None:
    with probe("_Good"):
        services = services_for("svc-probe")
        assert isinstance(services, _Good) and services_for("svc-probe") is services
        assert offered(services) == ("census", "preload")
        with pytest.raises(ServiceUnavailable, match="offers no 'start_server' service"):
            require("svc-probe", "start_server")


@pytest.mark.parametrize(
    ("cls_name", "message"),
    [
        ("_Misspelled", r"defines 'censsus': not a service; did you mean 'census'\?"),
        ("_WrongArguments", r"census\(self, config[^,]*\) -> .* does not take the arguments of ConnectorServices.census"),
        ("_HalfBench", r"offers 'raw_baseline' without 'bench_config'"),
        ("_EnvironmentWithoutVariables", r"server_environment and server_variables go together"),
        ("_BadPreload", r"preload must be a tuple of module names"),
        ("_FloorWithoutRaw", r"offers 'floor_baseline' without 'raw_baseline'"),
        ("_TargetOfAnUnknownVariant", r"bench target 'fast views' names variant 'view', which bench_variants lacks"),
        ("_TargetsNotSizeTargets", r"bench_targets must be a tuple of omni_plugins.bench.targets.SizeTarget"),
        ("_VariantNotAnOverlay", r"bench_variants must map variant names to config overlays"),
        ("_NotServices", r"is not a subclass of omni_plugins.services.ConnectorServices"),
        ("_Absent", r"cannot be imported"),
    ],
)
def test_a_wrong_declaration_is_refused_naming_it(probe: Any, cls_name: str, message: str) -> None:
    with probe(cls_name), pytest.raises(PluginLoadError, match=message) as info:
        services_for("svc-probe")
    assert f"{__name__}:{cls_name}" in str(info.value) and "svc-probe" in str(info.value)


def test_a_size_target_names_a_known_measure_and_a_positive_bound() -> None:
    assert SizeTarget("x", "put_ratio", 5.0).op == ">=" and SizeTarget("x", "cost", 1.2).op == "<="
    with pytest.raises(ValueError, match="unknown measure 'speed'"):
        SizeTarget("x", "speed", 1.0)
    with pytest.raises(ValueError, match="bound must be positive"):
        SizeTarget("x", "ratio", 0)


def test_run_scope_refuses_a_tag_that_would_widen_a_pattern() -> None:
    assert RunScope("abc123").request_prefix == "req-abc123-"
    for bad in (".*", "a*", "", "a-b"):
        with pytest.raises(ValueError, match="alphanumeric"):
            RunScope(bad)


def test_findings_read_as_report_lines() -> None:
    found = Finding(2, "Redis key(s)", "under 'p:'", ("p:a", "p:b"))
    assert found.census_line() == "2 Redis key(s) left under 'p:': ['p:a', 'p:b']"
    assert Finding(3, "store object(s) of this run", "on h:1", removed=True).census_line() == "3 store object(s) of this run left on h:1 (removed)"
    assert Finding(1, "shm file(s) of stopped stages").reclaim_line() == "removed 1 shm file(s) of stopped stages"


def _command_plugin(name: str, main: str = "json:dumps") -> types.ModuleType:
    module = types.ModuleType("cmd_probe_plugin")

    @hookimpl
    def omni_register_commands(commands: Any) -> None:
        commands.register(name, main=main, help="probe")

    module.omni_register_commands = omni_register_commands  # type: ignore[attr-defined]
    return module


def test_a_plugin_may_only_add_commands(omni_plugin_manager: PluginManager) -> None:
    with register_plugin(_command_plugin("probe-cmd"), manager=omni_plugin_manager) as status:
        assert status.status == "loaded" and status.commands == ["probe-cmd"] and status.connectors == []
        assert omni_plugin_manager.commands.get("probe-cmd") is not None
    assert omni_plugin_manager.commands.get("probe-cmd") is None  # unregistered with its plugin


@pytest.mark.parametrize(
    ("name", "message"),
    [("run", "is one of omni-plugins' own"), ("-x", "must be letters, digits and '-'"), ("ok", None)],
)
def test_command_names(omni_plugin_manager: PluginManager, name: str, message: str | None) -> None:
    with register_plugin(_command_plugin(name), manager=omni_plugin_manager) as status:
        if message is None:
            assert status.status == "loaded"
        else:
            assert status.status == "failed" and message in (status.error or "")


def test_two_plugins_cannot_add_the_same_command(omni_plugin_manager: PluginManager) -> None:
    with register_plugin(_command_plugin("same"), manager=omni_plugin_manager), register_plugin(
        _command_plugin("same"), manager=omni_plugin_manager
    ) as second:
        assert second.status == "failed" and "already provided by plugin" in (second.error or "")


def test_every_distribution_ships_py_typed() -> None:
    for pyproject in [ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml"), ROOT / "examples/custom-plugin/pyproject.toml"]:
        data = tomllib.loads(pyproject.read_text())
        package_data = data["tool"]["setuptools"]["package-data"]
        for package, files in package_data.items():
            assert "py.typed" in files and (pyproject.parent / package / "py.typed").is_file(), pyproject
        assert package_data, f"{pyproject} ships no py.typed"
