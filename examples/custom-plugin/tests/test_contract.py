"""The omni-plugins conformance kits, run against 'fs-dir': the connector (same process and across processes) and its services."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omni_plugins.testing import ConnectorContract, ServicesContract


@pytest.fixture
def payloads(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The test's payload directory; nothing may be left in it afterwards."""
    directory = tmp_path / "payloads"
    yield directory
    left = sorted(os.listdir(directory)) if directory.exists() else []
    assert left == [], f"files left behind: {left}"


class TestFsDirContract(ConnectorContract):
    cross_process = True
    bad_config = {"poll_interval": -1}

    @pytest.fixture
    def connector_spec(self, payloads: Path) -> tuple[str, dict[str, object]]:
        return "fs-dir", {"directory": str(payloads)}


class TestFsDirServices(ServicesContract):
    leftover = "killed"  # a SIGKILLed producer's payload file stays: the census must see it, reclaim free it

    @pytest.fixture
    def connector_spec(self, payloads: Path) -> tuple[str, dict[str, object]]:
        return "fs-dir", {"directory": str(payloads)}
