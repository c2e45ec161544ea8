"""Mistakes plugin authors make: each fails early (when the connector is chosen or validated) with a message naming it."""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_plugins import Connector, PluginLoadError, create_connector, hookimpl
from omni_plugins.factory import resolve_connector
from omni_plugins.testing import isolated_plugin_manager, register_plugin

MODULE = textwrap.dedent(
    """
    import os

    from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
    from omni_plugins.memory import MemoryConfig


    class Good(Connector):
        capabilities = Capabilities(cross_process=True)

        def __init__(self, config):
            super().__init__()
            self.store = {}

        def _put(self, f, t, key, data):
            self.store[key] = data
            return PutResult(True, 1)

        def _get(self, f, t, key, timeout):
            return GetResult(self.store.pop(key), 1) if key in self.store else None

        def _cleanup(self, key):
            return self.store.pop(key, None) is not None


    class NoCleanup(Connector):
        def __init__(self, config):
            super().__init__()

        def _put(self, f, t, key, data):
            return PutResult(True, 1)

        def _get(self, f, t, key, timeout):
            return None


    class NoArgs(Good):
        def __init__(self):
            super().__init__(None)


    class InitFails(Good):
        def __init__(self, config):
            super().__init__(config)
            os.makedirs(None)  # a TypeError of the backend's own, not a signature problem


    class NoSuper(Good):
        def __init__(self, config):
            self.store = {}
    """
)


@pytest.fixture
def mistakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of connector classes (importable as ``omni_test_mistakes``) and a plugin registering each."""
    (tmp_path / "omni_test_mistakes.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))

    class Plugin:
        @hookimpl
        def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]
            for name in ("Good", "NoCleanup", "NoArgs", "InitFails", "NoSuper"):
                registry.register(f"m-{name.lower()}", connector=f"omni_test_mistakes:{name}", config="omni_plugins.memory:MemoryConfig")

    with isolated_plugin_manager(), register_plugin(Plugin(), name="mistakes"):
        yield "mistakes"
    sys.modules.pop("omni_test_mistakes", None)


def test_the_good_one_works(mistakes: str) -> None:
    with create_connector("m-good") as conn:
        assert conn.put(0, 1, "k", {"a": 1}).ok


def test_an_abstract_primitive_left_is_named_at_load_time(mistakes: str) -> None:
    with pytest.raises(PluginLoadError, match=r"'m-nocleanup'.*plugin 'mistakes'.*does not implement _cleanup"):
        resolve_connector("m-nocleanup").load_class()  # what 'validate' does for a run file: no instance needed


def test_an_init_without_the_config_argument_is_named_at_load_time(mistakes: str) -> None:
    with pytest.raises(PluginLoadError, match=r"'m-noargs'.*must accept its config model as the only argument"):
        resolve_connector("m-noargs").load_class()


def test_a_type_error_inside_init_is_not_blamed_on_the_signature(mistakes: str) -> None:
    resolve_connector("m-initfails").load_class()  # the class itself is fine
    with pytest.raises(TypeError) as info:
        create_connector("m-initfails")
    assert "must accept its config model" not in str(info.value)
    assert not isinstance(info.value, PluginLoadError)


def test_a_missing_super_init_is_named_at_creation(mistakes: str) -> None:
    with pytest.raises(PluginLoadError, match=r"'m-nosuper'.*does not call super\(\).__init__\(\)"):
        create_connector("m-nosuper")


class _Sloppy(Connector):
    """Primitives that return the wrong things: the data itself, a bare bool, nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[str, Any] = {}

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> Any:
        self.store[key] = data
        return True

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> Any:
        return self.store.pop(key, None)

    def _cleanup(self, key: str) -> bool:
        return self.store.pop(key, None) is not None

    def _health(self) -> Any:
        return None


def test_primitives_returning_the_wrong_type_are_named_where_they_are_called() -> None:
    conn = _Sloppy()
    conn.name = "sloppy"
    with pytest.raises(TypeError, match=r"connector 'sloppy' \(.*_Sloppy\): _put\(\) returned bool True, expected a PutResult"):
        conn.put(0, 1, "k", {"a": 1})
    with pytest.raises(TypeError, match=r"_get\(\) returned dict .*expected a GetResult\(data, size\) or None"):
        conn.get(0, 1, "k")
    assert conn.get(0, 1, "k") is None  # None stays the answer for an absent key
    with pytest.raises(TypeError, match=r"_health\(\) returned NoneType None, expected a dict"):
        conn.health()


class _Undecorated:
    def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]  # forgot @hookimpl
        registry.register("undecorated", connector="omni_plugins.memory:MemoryConnector")


class _UndecoratedTypo:
    def omni_register_connector(self, registry):  # type: ignore[no-untyped-def]  # typo and no @hookimpl
        registry.register("typo", connector="omni_plugins.memory:MemoryConnector")


class _Returns:
    @hookimpl
    def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]
        return [{"name": "returned", "connector": "omni_plugins.memory:MemoryConnector"}]


class _RegistersNothing:
    @hookimpl
    def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]
        pass


class _WrongArgument:
    @hookimpl
    def omni_register_connectors(self, reg):  # type: ignore[no-untyped-def]
        reg.register("wrongarg", connector="omni_plugins.memory:MemoryConnector")


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (_Undecorated(), r"no @hookimpl omni_register_connectors.*without the @omni_plugins.hookimpl decorator"),
        (_UndecoratedTypo(), r"no @hookimpl .*it defines omni_register_connector\(\): a misspelling"),
        (_Returns(), r"returned list .*call registry.register"),
        (_RegistersNothing(), r"registered no connector"),
        # pluggy's message spans lines: all of it is kept (the useful part is not the first line)
        (_WrongArgument(), r"Argument\(s\) \{'reg'\} are declared in the hookimpl"),
    ],
)
def test_a_plugin_that_registers_nothing_fails_to_load_and_says_why(plugin: object, expected: str) -> None:
    with isolated_plugin_manager() as manager, register_plugin(plugin, name="sloppy") as status:
        assert status.status == "failed"
        assert re.search(expected, status.error or ""), status.error
        assert "\n" not in (status.error or "")
        assert manager.statuses["sloppy"].status == "failed"


def test_a_config_model_that_ignores_unknown_fields_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain pydantic model ignores unknown keys: 'directroy: /x' in the YAML would silently use the default."""
    (tmp_path / "omni_test_lax").mkdir()
    (tmp_path / "omni_test_lax" / "__init__.py").write_text("")
    (tmp_path / "omni_test_lax" / "mod.py").write_text(
        "from pydantic import BaseModel\n"
        "from omni_plugins.memory import MemoryConnector\n"
        "class LaxConfig(BaseModel):\n"
        "    directory: str = '/tmp/x'\n"
        "class LaxConnector(MemoryConnector):\n"
        "    config_model = LaxConfig\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class Plugin:
        @hookimpl
        def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]
            registry.register("lax", connector="omni_plugins.memory:MemoryConnector", config="omni_test_lax.mod:LaxConfig")

    try:
        with isolated_plugin_manager(), register_plugin(Plugin(), name="laxplugin"):
            with pytest.raises(PluginLoadError, match=r"'omni_test_lax.mod:LaxConfig' of connector 'lax' \(plugin 'laxplugin'.*accepts unknown"):
                create_connector("lax", {"directroy": "/x"})
            with pytest.raises(PluginLoadError, match=r"LaxConnector.config_model.*ConnectorSettings"):
                create_connector("omni_test_lax.mod:LaxConnector")
    finally:
        for name in ("omni_test_lax", "omni_test_lax.mod"):
            sys.modules.pop(name, None)
