"""The omni-plugins conformance kit, run against 'fs-dir' (same process and across processes)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omni_plugins.testing import ConnectorContract


class TestFsDirContract(ConnectorContract):
    cross_process = True
    bad_config = {"poll_interval": -1}

    @pytest.fixture
    def connector_spec(self, tmp_path: Path) -> tuple[str, dict[str, object]]:
        return "fs-dir", {"directory": str(tmp_path / "payloads")}

    @pytest.fixture(autouse=True)
    def _no_leftover_files(self, tmp_path: Path):  # type: ignore[no-untyped-def]
        yield
        directory = tmp_path / "payloads"
        left = sorted(os.listdir(directory)) if directory.exists() else []
        assert left == [], f"files left behind: {left}"
