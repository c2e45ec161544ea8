"""The core conformance suite against a standalone server and a 3-master cluster."""

from __future__ import annotations

from typing import Any

import pytest

from omni_plugins.testing import ConnectorContract


class TestStandaloneContract(ConnectorContract):
    cross_process = True
    bad_config = {"chunk_bytes": 10}

    @pytest.fixture
    def connector_spec(self, server_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "redis", server_config


class TestClusterContract(ConnectorContract):
    cross_process = True
    bad_config = {"cluster": True, "unix_socket": "/tmp/x.sock"}

    @pytest.fixture
    def connector_spec(self, cluster_config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "redis", cluster_config
