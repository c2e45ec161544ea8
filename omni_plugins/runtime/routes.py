"""The edges of one runtime, bound to their connectors: where sends go and where receives come from.

A runtime has one :class:`OutputRoute` per output edge and one
:class:`InputRoute` per input edge (a single-edge stage has one of each, or
none). Routes are fixed at construction; per-request progress on them lives in
the request's state (``RequestState.sent`` per output route,
``RequestState.inputs`` per input route).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_plugins.contract import Connector
from omni_plugins.metrics import NO_OBSERVER, EdgeObserver
from omni_plugins.payload import ResolvedBuilder


@dataclass(eq=False)
class OutputRoute:
    """One output edge: its connector, its key prefix and the builder of what its destination receives."""

    index: int
    from_stage: int
    to_stage: int
    #: the sending stage's part of the keys (``"0"``, or ``"0-1"`` when the stage fans out)
    key_stage: str
    connector: Connector
    #: the instance name in the pipeline (``None`` for a connector given without one)
    instance: str | None
    builder: ResolvedBuilder | None
    #: what the send thread reports each put to (metrics; :mod:`omni_plugins.runtime.observe`)
    observer: EdgeObserver = NO_OBSERVER

    def __post_init__(self) -> None:
        #: the stage ids as ``connector.put`` takes them (it would ``str()`` each per call)
        self.edge = (str(self.from_stage), str(self.to_stage))

    def key(self, external_id: str, chunk: int) -> str:
        return f"{external_id}_{self.key_stage}_{chunk}"


@dataclass(eq=False)
class InputRoute:
    """One input edge: its connector and the key prefix its sender uses."""

    index: int
    from_stage: int
    to_stage: int
    key_stage: str
    connector: Connector
    instance: str | None
    #: what the receive thread reports each arrival and failure to (metrics)
    observer: EdgeObserver = NO_OBSERVER

    def __post_init__(self) -> None:
        self.edge = (str(self.from_stage), str(self.to_stage))

    def key(self, external_id: str, chunk: int) -> str:
        return f"{external_id}_{self.key_stage}_{chunk}"
