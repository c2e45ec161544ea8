"""The stage graph as a runtime sees it: resolved edges and, per stage, the edges it owns.

An edge ``(from_stage, to_stage)`` may be written on either end
(``output_connectors.to_stage_N`` of the sender, ``input_connectors.from_stage_M``
of the receiver) or on both (then the ends agree: the loader checks it).
:func:`pipeline_edges` merges the two ends into one :class:`Edge`; the payload
builder comes from the sending end.

Keys. A payload's key carries the sending stage: ``{request}_{from}_{chunk}``.
When a stage sends on several output edges (fan-out), one request's chunk
goes to each destination under its own key, so the sending stage's part of
the key becomes ``{from}-{to}``: ``{request}_{from}-{to}_{chunk}`` (KV:
``{request}_{from}-{to}_{chunk}_{from_rank}_{to_rank}``). A stage with one
output edge keeps the plain form, so a single edge keys exactly as the
reference runtime does. Replicas need nothing in the key: a request id is
unique, and only the replica the request was routed to looks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from omni_plugins.config.models import ConnectorConfig, PipelineConfig


@dataclass(frozen=True)
class Edge:
    """One edge of the stage graph, both ends merged."""

    from_stage: int
    to_stage: int
    #: connector instance (under ``connectors``) that moves the edge's payloads
    connector: str
    #: connector instance that moves the edge's KV caches (the edge's connector unless set)
    kv_connector: str
    #: the builder of what ``to_stage`` receives (None: the sending stage's builder)
    payload_builder: str | None = None
    #: the sending stage's part of every key on this edge (``"0"``, or ``"0-1"`` when stage 0 fans out)
    key_stage: str = ""
    #: both ends have ``kv_transfer``: the sender's KV caches travel on this edge
    kv: bool = False

    @property
    def label(self) -> str:
        return f"{self.from_stage}->{self.to_stage}"


@dataclass(frozen=True)
class StageTopology:
    """What one stage's runtime needs of the graph: its input and output edges and their connector configs."""

    stage_id: int
    inputs: tuple[Edge, ...] = ()
    outputs: tuple[Edge, ...] = ()
    #: every connector instance an edge of this stage uses (payloads, and KV on KV edges), by instance name
    connectors: Mapping[str, ConnectorConfig] = field(default_factory=dict)

    @property
    def kv_input(self) -> Edge | None:
        """The input edge KV arrives on (the graph allows at most one)."""
        return next((e for e in self.inputs if e.kv), None)

    @property
    def kv_outputs(self) -> tuple[Edge, ...]:
        """Output edges the stage's KV caches go to (every one of them gets every KV transfer)."""
        return tuple(e for e in self.outputs if e.kv)

    def instances(self) -> list[str]:
        """Connector instances in first-use order: output edges, then input edges; payload connector before KV."""
        order: dict[str, None] = {}
        for e in (*self.outputs, *self.inputs):
            order[e.connector] = None
            if e.kv:
                order[e.kv_connector] = None
        return list(order)


def pipeline_edges(config: PipelineConfig) -> list[Edge]:
    """Every edge once, sorted by ``(from_stage, to_stage)``."""
    by_id = {s.stage_id: s for s in config.stages}
    ends: dict[tuple[int, int], tuple[str, str, str | None]] = {}
    for s in config.stages:
        for to, e in s.output_edges().items():
            ends[(s.stage_id, to)] = (e.connector, e.kv, e.payload_builder)
    for s in config.stages:
        for frm, e in s.input_edges().items():
            ends.setdefault((frm, s.stage_id), (e.connector, e.kv, None))
    fan_out: dict[int, int] = {}
    for frm, _ in ends:
        fan_out[frm] = fan_out.get(frm, 0) + 1
    edges = []
    for (frm, to), (connector, kv_connector, builder) in sorted(ends.items()):
        key_stage = f"{frm}-{to}" if fan_out[frm] > 1 else str(frm)
        kv = frm in by_id and to in by_id and by_id[frm].kv_transfer and by_id[to].kv_transfer
        edges.append(Edge(frm, to, connector, kv_connector, builder, key_stage, kv))
    return edges


def stage_topology(config: PipelineConfig, stage_id: int) -> StageTopology:
    config.stage(stage_id)  # KeyError naming the stages for an unknown id
    edges = pipeline_edges(config)
    inputs = tuple(e for e in edges if e.to_stage == stage_id)
    outputs = tuple(e for e in edges if e.from_stage == stage_id)
    topo = StageTopology(stage_id, inputs, outputs)
    return StageTopology(stage_id, inputs, outputs, {name: config.connectors[name] for name in topo.instances()})
