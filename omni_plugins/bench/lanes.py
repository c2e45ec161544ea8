"""Lanes: the ways the size curve moves a payload from the producer process to the consumer process.

Each lane has two ends, built separately in the two processes from a picklable :class:`LaneSpec`,
each with its own connections. ``raw`` and ``floor`` are the backend plugin's baselines
(``raw_baseline`` / ``floor_baseline`` services); ``connector`` is the connector itself with
``put`` and a blocking ``get`` of ``{"t": tensor}`` (wire-encoded, an owned result unless the
config says views); ``peer`` is vLLM-Omni's own connector of the backend's kind (:mod:`.peer`). A lane's ``put`` may return a token (JSON-able or picklable) the harness
hands to the consumer's ``get`` with the key, as a pipeline passes put's metadata along.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from omni_plugins.services import RawBaseline

#: a get that waits longer than this is a failed run, not a slow sample
TIMEOUT_S = 60.0

LaneKind = Literal["raw", "floor", "connector", "peer"]


class Lane(Protocol):
    """One end of a lane (the producer's or the consumer's)."""

    def handshake(self) -> Mapping[str, Any]: ...

    def connect(self, peer: Mapping[str, Any]) -> None: ...

    def put(self, key: str, payload: torch.Tensor) -> Any: ...

    def get(self, key: str, nbytes: int, token: Any) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LaneSpec:
    """Which lane: its kind, the backend, the connector config (a stage's ``extra``) and the largest payload.

    ``label`` names the lane in results (``raw``, ``floor``, ``connector``, ``connector:views``).
    """

    label: str
    kind: LaneKind
    backend: str
    config: dict[str, Any] = field(default_factory=dict)
    max_bytes: int = 0


class BaselineLane:
    """A plugin's raw or floor baseline end as a lane (its ``put`` returns no token)."""

    def __init__(self, end: RawBaseline) -> None:
        self._end = end

    def handshake(self) -> Mapping[str, Any]:
        return self._end.handshake()

    def connect(self, peer: Mapping[str, Any]) -> None:
        self._end.connect(peer)

    def put(self, key: str, payload: torch.Tensor) -> None:
        self._end.put(key, payload)

    def get(self, key: str, nbytes: int, token: Any) -> torch.Tensor:
        return self._end.get(key, nbytes)

    def close(self) -> None:
        self._end.close()


class ConnectorLane:
    """The connector: ``put(0, 1, key, {"t": payload})``, a blocking ``get``; the result's tensor is returned."""

    def __init__(self, backend: str, config: Mapping[str, Any]) -> None:
        from omni_plugins import create_connector

        self._connector = create_connector(backend, dict(config))

    def handshake(self) -> Mapping[str, Any]:
        return {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        return None

    def put(self, key: str, payload: torch.Tensor) -> None:
        result = self._connector.put(0, 1, key, {"t": payload})
        if not result.ok:
            raise RuntimeError(f"put of {key} failed: {result.metadata}")

    def get(self, key: str, nbytes: int, token: Any) -> Any:
        result = self._connector.get(0, 1, key, timeout=TIMEOUT_S)
        if result is None:
            raise TimeoutError(f"get of {key} found nothing within {TIMEOUT_S:.0f}s")
        return result.data["t"]

    def close(self) -> None:
        self._connector.close()


def make_lane(spec: LaneSpec, producer: bool) -> Lane:
    """This process's end of ``spec``'s lane."""
    if spec.kind == "connector":
        return ConnectorLane(spec.backend, spec.config)
    if spec.kind == "peer":  # vLLM-Omni's own connector of the backend's kind (its integration venv)
        from omni_plugins.bench.peer import PeerLane, peer_name

        return PeerLane(peer_name(spec.backend), producer)
    from omni_plugins.factory import validate_connector_config
    from omni_plugins.services import require

    service = "raw_baseline" if spec.kind == "raw" else "floor_baseline"
    services = require(spec.backend, service)
    config = validate_connector_config(spec.backend, spec.config)
    end = getattr(services, service)(config, spec.max_bytes, producer)
    return BaselineLane(end)
