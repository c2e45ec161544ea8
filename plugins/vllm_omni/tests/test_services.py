"""The services kit against the vllm-omni connector: census and reclaim of vLLM-Omni's shared-memory files, preload."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")

from omni_plugins_vllm_omni.bridge_config import VllmOmniConfig
from omni_plugins_vllm_omni.services import VllmOmniServices

from omni_plugins.services import RunScope, ServiceUnavailable
from omni_plugins.testing import ServicesContract


class TestVllmOmniServices(ServicesContract):
    leftover = "open"  # a SIGKILLed producer's segments are unlinked by Python's resource tracker when the test ends

    @pytest.fixture
    def connector_spec(self) -> tuple[str, dict[str, Any]]:
        return "vllm-omni", {"connector": "SharedMemoryConnector"}


def test_transfer_engines_leave_nothing_and_stores_cannot_be_listed() -> None:
    services, run = VllmOmniServices(), RunScope("abc123")
    assert services.census(VllmOmniConfig(connector="NixlConnector"), run).count == 0
    with pytest.raises(ServiceUnavailable, match="MooncakeStoreConnector"):
        services.census(VllmOmniConfig(connector="MooncakeStoreConnector"), run)
