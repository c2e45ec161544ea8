"""The services kit against the Mooncake plugin: the store's census (which removes), its master, both raw baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omni_plugins_mooncake.testing import MooncakeMaster

from omni_plugins.testing import ServicesContract

from .conftest import SEGMENT, store_config


class TestStoreServices(ServicesContract):
    # a client's objects live in its own segment and go with it: the leftover is held by a live client
    leftover = "open"
    server_overrides = {"global_segment_size": SEGMENT, "local_buffer_size": "16MiB"}

    @pytest.fixture
    def connector_spec(self, master: MooncakeMaster) -> tuple[str, dict[str, Any]]:
        return "mooncake-store", store_config(master)


class TestTEServices(ServicesContract):
    @pytest.fixture
    def connector_spec(self, tmp_path: Path) -> tuple[str, dict[str, Any]]:
        return "mooncake-te", {"rendezvous_dir": str(tmp_path / "peers"), "pool_size": "256MiB", "socket_timeout": 5.0}
