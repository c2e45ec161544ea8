"""The core conformance suite against ``mooncake-store`` with a real master."""

from __future__ import annotations

from typing import Any

import pytest

from omni_plugins.testing import ConnectorContract

from .conftest import store_config


class TestMooncakeStoreContract(ConnectorContract):
    cross_process = True
    bad_config = {"master_address": "no-port-here"}

    @pytest.fixture
    def connector_spec(self, master: Any) -> tuple[str, dict[str, Any]]:
        return "mooncake-store", store_config(master)
