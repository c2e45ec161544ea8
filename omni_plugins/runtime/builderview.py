"""What a payload builder sees as ``transfer_manager`` when its connector carries builder settings.

vLLM-Omni's builders read their knobs (``codec_chunk_frames``, ``codec_left_context_frames`` ...)
from their connector's config: ``transfer_manager.connector.config``, a mapping (the connector's
YAML ``extra``). An omni-plugins connector's ``config`` is its plugin's settings model, so for a
connector instance with ``builder_settings`` the builder gets this view instead of the runtime:
the runtime in every respect (attributes read and set go to it: builders keep per-request state
on it), except ``connector``, whose ``config`` is those settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_plugins.contract import Connector


class ConnectorView:
    """A connector whose ``config`` is the builder settings; everything else is the connector's."""

    __slots__ = ("_connector", "config")

    def __init__(self, connector: Connector, settings: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_connector", connector)
        object.__setattr__(self, "config", dict(settings))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._connector, name)


class BuilderManager:
    """The runtime as a builder's ``transfer_manager``, with ``connector`` a :class:`ConnectorView`."""

    __slots__ = ("_runtime", "connector")

    def __init__(self, runtime: Any, connector: Connector, settings: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_runtime", runtime)
        object.__setattr__(self, "connector", ConnectorView(connector, settings))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._runtime, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._runtime, name)
