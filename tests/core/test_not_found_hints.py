"""What a failed connector lookup says: installed but disabled / not allowed, wrong ``dist:name``, not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_plugins.errors import ConnectorNotFoundError
from omni_plugins.plugins import PluginManager
from omni_plugins.registry import ConnectorRegistry, ConnectorSpec
from omni_plugins.testing import isolated_plugin_manager

SHM = ConnectorSpec("shm", "omni_plugins_shm.connector:ShmConnector", aliases=("SharedMemoryConnector",), distribution="omni-plugins-shm")


def _message(registry: ConnectorRegistry, name: str) -> str:
    with pytest.raises(ConnectorNotFoundError) as info:
        registry.resolve(name)
    return str(info.value)


def test_a_disabled_plugin_is_not_called_not_installed() -> None:
    registry = ConnectorRegistry()
    registry.note_skipped("shm", "omni-plugins-shm", "disabled by OMNI_PLUGINS_DISABLE")
    for name in ("shm", "SharedMemoryConnector", "omni-plugins-shm:shm"):
        msg = _message(registry, name)
        assert "its plugin 'shm' (omni-plugins-shm) is installed but disabled by OMNI_PLUGINS_DISABLE." in msg, msg
        assert "not installed" not in msg


def test_a_plugin_outside_the_allow_list_names_its_other_connectors_too() -> None:
    registry = ConnectorRegistry()
    registry.note_skipped("mooncake", "omni-plugins-mooncake", "not loaded: it is not in OMNI_PLUGINS='redis'")
    msg = _message(registry, "mooncake-te")
    assert "its plugin 'mooncake' (omni-plugins-mooncake) is installed but not loaded: it is not in OMNI_PLUGINS='redis'." in msg


def test_a_missing_plugin_says_what_to_install_in_a_sentence_of_its_own() -> None:
    msg = _message(ConnectorRegistry(), "shm")
    assert "It is provided by a plugin that is not installed (pip install omni-plugins-shm). Available: (none)." in msg


def test_a_wrong_distribution_prefix_names_the_one_that_provides_it() -> None:
    registry = ConnectorRegistry()
    registry.add(SHM)
    msg = _message(registry, "omni-plugins-redis:shm")
    assert "distribution 'omni-plugins-redis' does not provide a connector 'shm'" in msg
    assert "omni-plugins-shm does: use 'omni-plugins-shm:shm' (or just 'shm')" in msg
    assert "not installed" not in msg


def test_the_plugin_manager_records_disabled_and_blocked_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("omni_plugins_shm")
    monkeypatch.delenv("OMNI_PLUGINS", raising=False)
    monkeypatch.setenv("OMNI_PLUGINS_DISABLE", "shm")
    manager = PluginManager()
    manager.load()
    assert "disabled by OMNI_PLUGINS_DISABLE" in _message(manager.registry, "shm")
    monkeypatch.delenv("OMNI_PLUGINS_DISABLE")
    monkeypatch.setenv("OMNI_PLUGINS", "nothing-else")
    manager = PluginManager()
    manager.load()
    assert "not loaded: it is not in OMNI_PLUGINS='nothing-else'" in _message(manager.registry, "shm")


def test_an_installed_distribution_without_the_entry_point_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin installed before its pyproject had the entry point (or without one): 'unknown connector' alone misleads."""
    info = tmp_path / "omni_plugins_noentry-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-plugins-noentry\nVersion: 0.1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with isolated_plugin_manager() as manager:
        with pytest.raises(ConnectorNotFoundError, match=r"'omni-plugins-noentry' is installed but declares no entry point.*reinstall"):
            manager.registry.resolve("noentry")
        with pytest.raises(ConnectorNotFoundError) as info_:
            manager.registry.resolve("nothing-at-all")
        assert "entry point" not in str(info_.value)
