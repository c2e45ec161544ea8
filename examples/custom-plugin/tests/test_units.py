"""Unit tests of the 'fs-dir' connector: atomic visibility, file modes, odd keys, discovery.

``omni_connector`` (a fixture of omni-plugins' pytest plugin) creates connectors that are closed
after the test, whatever happens in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from omni_plugins import available_connectors
from omni_plugins.errors import ConfigError
from omni_plugins.testing import ConnectorFactory


def test_discovered_through_the_entry_point() -> None:
    assert "fs-dir" in available_connectors()


def test_usable_by_import_path_with_its_settings(tmp_path: Path, omni_connector: ConnectorFactory) -> None:
    path = "omni_plugins_fs_dir.connector:FsDirConnector"
    conn = omni_connector(path, {"directory": str(tmp_path)})
    assert conn.put(0, 1, "k", {"v": 1}).ok
    got = conn.get(0, 1, "k")
    assert got is not None and got.data == {"v": 1}
    with pytest.raises(ConfigError, match="directoy"):
        omni_connector(path, {"directoy": str(tmp_path)})


def test_temp_files_are_invisible_and_files_are_private(tmp_path: Path, omni_connector: ConnectorFactory) -> None:
    conn = omni_connector("fs-dir", {"directory": str(tmp_path)})
    (tmp_path / ".tmp-someone-else").write_bytes(b"half a payload")
    assert conn.get(0, 1, ".tmp-someone-else") is None
    assert conn.put(0, 1, "k", {"x": torch.arange(4)}).ok
    payload_files = [p for p in tmp_path.iterdir() if p.name.startswith("k-")]
    assert len(payload_files) == 1
    assert stat.S_IMODE(payload_files[0].stat().st_mode) == 0o600
    got = conn.get(0, 1, "k")
    assert got is not None and torch.equal(got.data["x"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir()] == [".tmp-someone-else"]


def test_keys_with_slashes_and_long_keys(tmp_path: Path, omni_connector: ConnectorFactory) -> None:
    conn = omni_connector("fs-dir", {"directory": str(tmp_path)})
    for key in ("../../etc/passwd", "a/b/c", "x" * 500, "ünïcode key"):
        assert conn.put(0, 1, key, {"k": key}).ok
        got = conn.get(0, 1, key)
        assert got is not None and got.data == {"k": key}
    assert os.listdir(tmp_path) == []


def test_a_put_replaces_an_unread_payload(tmp_path: Path, omni_connector: ConnectorFactory) -> None:
    conn = omni_connector("fs-dir", {"directory": str(tmp_path)})
    conn.put(0, 1, "k", {"v": 1})
    conn.put(0, 1, "k", {"v": 2})
    got = conn.get(0, 1, "k")
    assert got is not None and got.data == {"v": 2}
    assert conn.get(0, 1, "k") is None
