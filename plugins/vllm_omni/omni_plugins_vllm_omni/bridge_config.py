"""Config model of the ``vllm-omni`` connector (imports nothing of vLLM-Omni)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from omni_plugins.settings import ConnectorSettings


class VllmOmniConfig(ConnectorSettings):
    """Which vLLM-Omni connector to build, and its ``extra`` (given to it unchanged).

    vLLM-Omni's transfer-engine connectors (NIXL, Mori, Mooncake TE) read their role, stage and
    ports from ``extra`` (``role``, ``stage_id``, ``from_stage``, ``to_stage``, ``zmq_port``,
    ``sender_host``, ``sender_zmq_port``): an omni-plugins pipeline does not inject them, so a
    stage's YAML sets them.
    """

    connector: str = Field(
        min_length=1, description="a name vLLM-Omni's connector factory knows: SharedMemoryConnector, NixlConnector, ..."
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="that connector's settings, as in a vLLM-Omni YAML")
    get_poll_max_s: float = Field(
        0.02, gt=0, le=1, description="a get with a timeout polls the wrapped connector, backing off from 0.5 ms to this"
    )
