"""The services kit against the shm plugin: census and reclaim of a killed producer's files, the raw baseline."""

from __future__ import annotations

from typing import Any

import pytest

from omni_plugins.testing import ServicesContract


class TestShmServices(ServicesContract):
    leftover = "killed"

    @pytest.fixture
    def connector_spec(self, namespace: str) -> tuple[str, dict[str, Any]]:
        return "shm", {"namespace": namespace}
