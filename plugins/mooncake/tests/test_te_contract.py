"""The core conformance suite against ``mooncake-te`` (TransferEngine over loopback TCP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omni_plugins.testing import ConnectorContract


class TestMooncakeTEContract(ConnectorContract):
    cross_process = True
    bad_config = {"peers": ["127.0.0.1"]}

    @pytest.fixture
    def connector_spec(self, tmp_path: Path) -> tuple[str, dict[str, Any]]:
        # identically configured instances find each other through the rendezvous directory
        return "mooncake-te", {"rendezvous_dir": str(tmp_path / "peers"), "pool_size": "256MiB", "socket_timeout": 5.0}
