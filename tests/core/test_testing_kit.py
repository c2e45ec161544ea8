"""The plugin authors' testing kit: isolated managers and self-undoing registration."""

from __future__ import annotations

import pytest

from omni_plugins import ConnectorNotFoundError, available_connectors, create_connector, hookimpl
from omni_plugins.plugins import get_plugin_manager
from omni_plugins.testing import isolated_plugin_manager, register_plugin


class _Plugin:
    @hookimpl
    def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]
        registry.register("kit-test", connector="omni_plugins.memory:MemoryConnector", config="omni_plugins.memory:MemoryConfig")


def test_isolated_manager_has_only_builtins() -> None:
    outer = get_plugin_manager()
    with isolated_plugin_manager() as manager:
        assert get_plugin_manager() is manager
        assert set(available_connectors()) == {"memory"}
    assert get_plugin_manager() is outer


def test_register_plugin_undoes_itself() -> None:
    with isolated_plugin_manager():
        with register_plugin(_Plugin()) as status:
            assert status.status == "loaded" and status.connectors == ["kit-test"]
            with create_connector("KIT_TEST", {"namespace": "kit"}) as conn:
                assert conn.put(0, 1, "k", {"a": 1}).ok
        with pytest.raises(ConnectorNotFoundError):
            create_connector("kit-test")


def test_register_rejects_bad_import_strings() -> None:
    class Bad:
        @hookimpl
        def omni_register_connectors(self, registry):  # type: ignore[no-untyped-def]
            registry.register("bad", connector="not an import string")

    with isolated_plugin_manager(), register_plugin(Bad()) as status:
        assert status.status == "failed"
        assert "import string" in (status.error or "")
