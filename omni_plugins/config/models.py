"""Pydantic v2 models of connector, stage and pipeline configuration.

Validation has two phases: these models check structure (names present,
references resolve, edges agree, no cycles); then each connector's ``extra``
is validated by the plugin's own model (:func:`validate_plugin_configs`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator, model_validator

_EDGE_RE = {"input": re.compile(r"^from_stage_(\d+)$"), "output": re.compile(r"^to_stage_(\d+)$")}
_INT_TEXT = re.compile(r"[+-]?[0-9]+")

#: stage ids are small (they are in every key and edge name); a bound catches a mistyped id
MAX_STAGE_ID = 9999


def _int_from_text(v: Any) -> Any:
    """A digit string (what ``${VAR}`` interpolation gives) as an int; anything else is left to strict validation."""
    return int(v) if isinstance(v, str) and _INT_TEXT.fullmatch(v.strip()) else v


def _bool_from_text(v: Any) -> Any:
    """``"true"`` / ``"false"`` (what ``${VAR}`` interpolation gives) as a bool; not ``yes``, ``on``, ``1``."""
    return {"true": True, "false": False}.get(v.strip().lower(), v) if isinstance(v, str) else v


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError(f"Input should be a number, not a boolean ({str(v).lower()})")
    return v


#: an int that is not a bool (YAML ``true`` is not 1) nor a float; digit strings convert
Int = Annotated[int, BeforeValidator(_int_from_text), Strict()]
#: a bool that is YAML ``true``/``false`` (or that text), not ``yes``/``on``/``1``
Bool = Annotated[bool, BeforeValidator(_bool_from_text), Strict()]
#: a float that is not a bool; ints and numeric strings convert
Float = Annotated[float, BeforeValidator(_not_bool)]

Loc = tuple[str | int, ...]

if TYPE_CHECKING:
    from omni_plugins.config.topology import Edge, StageTopology


class GraphProblem(NamedTuple):
    """One error of the stage graph: where it is (a pydantic-style location), the old prefix, the message."""

    loc: Loc
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


class GraphError(ValueError):
    """The stage graph is invalid (references, duplicate ids, disagreeing edge ends, cycles).

    Raised by a model-level validator, which pydantic reports at the top level; the YAML loader
    reads :attr:`problems` (it is the ``ctx['error']`` of the pydantic error) to give each one its
    own line and field.
    """

    def __init__(self, problems: list[GraphProblem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def _edge_stage(key: str) -> int:
    """N of an edge key ``from_stage_N`` / ``to_stage_N`` (already checked by the field validator)."""
    return int(key.rsplit("_", 1)[1])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConnectorConfig(_Strict):
    """A named connector instance: which plugin (``name``) and its settings (``extra``)."""

    name: str = Field(description="registered connector name, alias, 'dist:name' or 'pkg.mod:Class'")
    extra: dict[str, Any] = Field(default_factory=dict, description="settings validated by the plugin's config model")
    builder_settings: dict[str, Any] = Field(
        default_factory=dict,
        description="settings the payload builders read from their connector's config (transfer_manager.connector.config), "
        "not the backend: a vLLM-Omni file's extra as written",
    )

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("connector name must not be blank")
        return v.strip()


class RankMapping(_Strict):
    """Tensor-parallel sizes on both ends of an edge."""

    from_tp: Int = Field(default=1, gt=0)
    to_tp: Int = Field(default=1, gt=0)
    #: the model's total KV heads. Needed only when it is smaller than ``from_tp``: each KV head is then
    #: replicated on ``from_tp // num_kv_heads`` sender ranks, and a receiver merging their shards keeps one copy
    num_kv_heads: Int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _divisible(self) -> RankMapping:
        big, small = max(self.from_tp, self.to_tp), min(self.from_tp, self.to_tp)
        if big % small:
            raise ValueError(f"the larger TP size must be divisible by the smaller: from_tp={self.from_tp}, to_tp={self.to_tp}")
        heads = self.num_kv_heads
        if heads is not None and heads < self.from_tp and self.from_tp % heads:
            raise ValueError(
                f"with fewer KV heads than sender ranks, from_tp must be a multiple of num_kv_heads (each head replicated "
                f"on the same number of ranks): from_tp={self.from_tp}, num_kv_heads={heads}"
            )
        return self

    @property
    def head_replicas(self) -> int:
        """Sender ranks holding a copy of the same KV head (1 unless ``num_kv_heads < from_tp``)."""
        heads = self.num_kv_heads
        return self.from_tp // heads if heads is not None and heads < self.from_tp else 1

    @property
    def ratio(self) -> int:
        return max(self.from_tp, self.to_tp) // min(self.from_tp, self.to_tp)


class StageConnectorConfig(_Strict):
    """What one stage's runtime needs: its connector, where it sends, how ranks map."""

    name: str
    extra: dict[str, Any] = Field(default_factory=dict)
    to_stage: Int | None = None
    rank_mapping: RankMapping = Field(default_factory=RankMapping)
    builder_settings: dict[str, Any] = Field(default_factory=dict, description="what the payload builders read as their connector's config")

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, v: str) -> str:
        if not isinstance(v, str) or not v.strip():
            raise ValueError("connector name must not be blank")
        return v.strip()

    @field_validator("to_stage", mode="before")
    @classmethod
    def _numeric_string(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v.strip().lstrip("-").isdigit():
                raise ValueError(f"to_stage must be an int or a numeric string, got {v!r}")
            return int(v)
        return v


def _edge_ref(v: Any) -> Any:
    """An edge value: an instance name (the short form) or an :class:`EdgeConfig` mapping."""
    if isinstance(v, str):
        return {"connector": v}
    if isinstance(v, (dict, EdgeConfig)):
        return v
    raise ValueError(
        f"an edge names a connector instance, or is a mapping {{connector, kv_connector, payload_builder}}; got {type(v).__name__} {v!r}"
    )


class EdgeConfig(_Strict):
    """One end of an edge ``(from_stage, to_stage)``: its connector instance, its KV connector, its payload builder.

    Written as an instance name (``to_stage_1: shm``) or as a mapping
    (``to_stage_1: {connector: shm, kv_connector: mc, payload_builder: pkg.mod.fn}``).
    """

    connector: str = Field(description="connector instance (under 'connectors') that moves this edge's payloads")
    kv_connector: str | None = Field(default=None, description="connector instance for this edge's KV caches (default: connector)")
    payload_builder: str | None = Field(
        default=None, description="sending end only: dotted path of the builder for this destination (default: the stage's builder)"
    )

    @field_validator("connector", "kv_connector")
    @classmethod
    def _instance_not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must name a connector instance")
        return v.strip() if v is not None else None

    @property
    def kv(self) -> str:
        """The KV connector instance (the edge's connector unless ``kv_connector`` is set)."""
        return self.kv_connector or self.connector


EdgeRef = Annotated[EdgeConfig, BeforeValidator(_edge_ref)]

#: how a request picks one replica of a replicated stage
RoutingPolicy = Literal["round_robin", "least_inflight"]
DEFAULT_ROUTING: RoutingPolicy = "round_robin"


class StageConfig(_Strict):
    """One stage of a pipeline."""

    stage_id: Int = Field(ge=0, le=MAX_STAGE_ID)
    worker_type: Literal["ar", "generation"] = "ar"
    async_chunk: Bool = False
    final_output: Bool = False
    model_stage: str | None = None
    custom_process_input_func: str | None = None
    custom_process_next_stage_input_func: str | None = None
    cfg_kv_collect_func: str | None = Field(
        default=None,
        description="dotted path of the function that turns the KV of a request's CFG companions into its sampling-param "
        "fields: vLLM-Omni's f(request_id, cfg_request_ids, kv_transfer_manager, target_device) (BAGEL's collect_cfg_kv_caches) "
        "or f(request_id, {role: (payload, size)}); receive_multi_kv_cache uses it when the caller passes none",
    )
    input_connectors: dict[str, EdgeRef] = Field(default_factory=dict, description="{from_stage_N: connector instance or edge mapping}")
    output_connectors: dict[str, EdgeRef] = Field(default_factory=dict, description="{to_stage_N: connector instance or edge mapping}")
    rank_mapping: RankMapping | None = None
    tp_size: Int = Field(default=1, gt=0)
    kv_transfer: Bool = False
    kv_layout: Literal["auto", "nhd", "hnd"] = Field(
        default="auto", description="paged KV cache layout; 'auto' refuses to guess when heads per rank equal the block size"
    )
    recv_timeout_s: Float = Field(default=300.0, gt=0, allow_inf_nan=False)
    replicas: Int = Field(default=1, gt=0, le=1024, description="copies of this stage (each its own process or TP group)")
    routing: RoutingPolicy | None = Field(
        default=None, description=f"how a request picks one replica (replicated stages only; default {DEFAULT_ROUTING})"
    )
    synthetic: dict[str, Any] | None = Field(default=None, description="synthetic model description used by 'omni-plugins run'")
    vllm_omni: dict[str, Any] = Field(
        default_factory=dict, description="the stage's vLLM-Omni settings omni-plugins does not use (engine, placement, sampling), kept"
    )

    @field_validator("input_connectors", "output_connectors")
    @classmethod
    def _edge_keys(cls, v: dict[str, EdgeConfig], info: Any) -> dict[str, EdgeConfig]:
        kind = "input" if info.field_name == "input_connectors" else "output"
        pattern = _EDGE_RE[kind]
        for key in v:
            if not pattern.match(str(key)):
                want = "from_stage_<N>" if kind == "input" else "to_stage_<N>"
                raise ValueError(f"edge key {key!r} must look like {want!r}")
        return v

    @property
    def routing_policy(self) -> RoutingPolicy:
        """The replica routing policy in effect (``routing``, else the default)."""
        return self.routing or DEFAULT_ROUTING

    def input_edges(self) -> dict[int, EdgeConfig]:
        """``{from_stage: edge}`` as written on this stage."""
        return {_edge_stage(k): v for k, v in self.input_connectors.items()}

    def output_edges(self) -> dict[int, EdgeConfig]:
        """``{to_stage: edge}`` as written on this stage."""
        return {_edge_stage(k): v for k, v in self.output_connectors.items()}

    def input_stages(self) -> dict[int, str]:
        """``{from_stage: connector instance}`` as written on this stage."""
        return {n: e.connector for n, e in self.input_edges().items()}

    def output_stages(self) -> dict[int, str]:
        """``{to_stage: connector instance}`` as written on this stage."""
        return {n: e.connector for n, e in self.output_edges().items()}


_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def split_host_port(address: str, *, any_port: bool = False) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``; ``ValueError`` naming what is wrong. ``any_port``: port 0 too."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    low = 0 if any_port else 1
    if not sep or not host or not port.isdigit() or not low <= int(port) < 65536:
        raise ValueError(f"expected host:port with a port from {low} to 65535, got {address!r}")
    return host, int(port)


class PlacementConfig(_Strict):
    """Which machine runs which stages: ``omni-plugins run PIPELINE.yaml --host NAME`` on each of them.

    The coordinating host (``coordinator``, default the first one listed) serves the
    control channel on ``control``; every other host joins it there.
    """

    hosts: dict[str, list[Int]] = Field(min_length=1, description="{host name: [stage ids it runs]}; every stage on exactly one host")
    control: str | None = Field(
        default=None, description="host:port the coordinating host serves the control channel on (the others connect to it)"
    )
    coordinator: str | None = Field(default=None, description="the host that serves the control channel and feeds requests (default: the first)")

    @field_validator("hosts")
    @classmethod
    def _names(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        for name, stages in v.items():
            if not isinstance(name, str) or not _HOST_NAME.match(name):
                raise ValueError(f"host name {name!r}: letters, digits, '.', '_' and '-', at most 63, starting with a letter or digit")
            if not stages:
                raise ValueError(f"host {name!r} runs no stage")
        return v

    @field_validator("control")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            split_host_port(v)
        return v

    @model_validator(mode="after")
    def _coordinator_known(self) -> PlacementConfig:
        if self.coordinator is not None and self.coordinator not in self.hosts:
            raise ValueError(f"coordinator {self.coordinator!r} is not one of the hosts ({sorted(self.hosts)})")
        return self

    @property
    def coordinating_host(self) -> str:
        return self.coordinator or next(iter(self.hosts))

    def host_of(self, stage_id: int) -> str | None:
        return next((name for name, stages in self.hosts.items() if stage_id in stages), None)


class PipelineConfig(_Strict):
    """A whole pipeline: named connector instances and the stages they wire together."""

    connectors: dict[str, ConnectorConfig] = Field(default_factory=dict)
    stages: list[StageConfig] = Field(min_length=1)
    default_connector: str | None = None
    vllm_omni: dict[str, Any] = Field(default_factory=dict, description="pipeline-wide vLLM-Omni settings omni-plugins does not use, kept")
    placement: PlacementConfig | None = Field(default=None, description="which host runs which stages (a pipeline across machines)")

    @model_validator(mode="after")
    def _check_graph(self) -> PipelineConfig:
        problems = self._graph_problems()
        if problems:
            raise GraphError(problems)
        return self

    def _graph_problems(self) -> list[GraphProblem]:
        problems: list[GraphProblem] = []
        first: dict[int, int] = {}
        for i, s in enumerate(self.stages):
            if s.stage_id in first:
                problems.append(GraphProblem(("stages", i, "stage_id"), "", f"duplicate stage_id [{s.stage_id}] (also stages[{first[s.stage_id]}])"))
            first.setdefault(s.stage_id, i)
        if self.default_connector is not None and self.default_connector not in self.connectors:
            problems.append(
                GraphProblem(
                    ("default_connector",),
                    "",
                    f"default_connector {self.default_connector!r} is not defined under 'connectors' (defined: {sorted(self.connectors)})",
                )
            )
        by_id = {s.stage_id: s for s in self.stages}
        for i, s in enumerate(self.stages):
            problems += self._edge_end_problems(i, s, by_id)
            if s.routing is not None and s.replicas == 1:
                problems.append(
                    GraphProblem(
                        ("stages", i, "routing"),
                        f"stage {s.stage_id}: routing",
                        "routing picks one replica of a replicated stage; set replicas above 1 (or drop routing)",
                    )
                )
        problems += self._placement_problems(by_id)
        if not problems:
            problems += self._cycle_problems()
        if not problems:
            problems += self._kv_input_problems()
        if not problems:
            problems += self._cycle_problems()
        return problems

    def _placement_problems(self, by_id: dict[int, StageConfig]) -> list[GraphProblem]:
        """Every placed stage exists, and every stage is placed on exactly one host."""
        if self.placement is None:
            return []
        problems: list[GraphProblem] = []
        placed: dict[int, str] = {}
        for host, stages in self.placement.hosts.items():
            for j, sid in enumerate(stages):
                loc: Loc = ("placement", "hosts", host, j)
                if sid not in by_id:
                    problems.append(GraphProblem(loc, f"placement.hosts.{host}", f"stage {sid} does not exist (stages: {sorted(by_id)})"))
                elif sid in placed:
                    twice = "listed twice" if placed[sid] == host else f"placed on {placed[sid]!r} too"
                    problems.append(GraphProblem(loc, f"placement.hosts.{host}", f"stage {sid} is {twice}; a stage runs on one host"))
                else:
                    placed[sid] = host
        missing = sorted(set(by_id) - set(placed))
        if missing:
            problems.append(GraphProblem(("placement", "hosts"), "placement.hosts", f"stage(s) {missing} are on no host; place every stage"))
        return problems

    def _edge_end_problems(self, i: int, s: StageConfig, by_id: dict[int, StageConfig]) -> list[GraphProblem]:
        """What is wrong with the edge ends written on stage ``s`` (index ``i``)."""
        problems: list[GraphProblem] = []
        defined = f"is not defined under 'connectors' (defined: {sorted(self.connectors)})"
        for kind in ("input_connectors", "output_connectors"):
            side = "from" if kind.startswith("input") else "to"
            for key, edge in getattr(s, kind).items():
                other = _edge_stage(key)
                loc: Loc = ("stages", i, kind, key)
                where = f"stage {s.stage_id}: {kind}.{side}_stage_{other}"
                if edge.connector not in self.connectors:
                    problems.append(GraphProblem(loc, where, f"connector instance {edge.connector!r} {defined}"))
                if edge.kv_connector is not None and edge.kv_connector not in self.connectors:
                    problems.append(GraphProblem((*loc, "kv_connector"), f"{where}.kv_connector", f"connector instance {edge.kv_connector!r} {defined}"))
                if kind == "input_connectors" and edge.payload_builder is not None:
                    problems.append(
                        GraphProblem(
                            (*loc, "payload_builder"),
                            f"{where}.payload_builder",
                            f"a payload builder belongs on the sending end: set it in stage {other}'s output_connectors.to_stage_{s.stage_id}",
                        )
                    )
                if other not in by_id:
                    problems.append(GraphProblem(loc, where, f"stage {other} does not exist (stages: {sorted(by_id)})"))
                elif other == s.stage_id:
                    problems.append(GraphProblem(loc, where, "a stage cannot connect to itself"))
        for key, edge in s.output_connectors.items():
            other = _edge_stage(key)
            peer = by_id[other].input_edges().get(s.stage_id) if other in by_id else None
            if peer is None:
                continue
            loc = ("stages", i, "output_connectors", key)
            where = f"stage {s.stage_id}: output_connectors.to_stage_{other}"
            theirs = f"stage {other}: input_connectors.from_stage_{s.stage_id}"
            if peer.connector != edge.connector:
                problems.append(
                    GraphProblem(loc, where, f"uses {edge.connector!r} but {theirs} uses {peer.connector!r}; both ends of an edge must agree")
                )
            elif peer.kv != edge.kv:
                problems.append(
                    GraphProblem(
                        loc,
                        where,
                        f"moves KV over {edge.kv!r} but {theirs} over {peer.kv!r} (kv_connector, default: the edge's connector); "
                        "both ends of an edge must agree",
                    )
                )
        return problems

    def _kv_input_problems(self) -> list[GraphProblem]:
        """A stage receives KV over at most one input edge (a KV edge: both ends have ``kv_transfer``)."""
        problems: list[GraphProblem] = []
        by_id = {s.stage_id: s for s in self.stages}
        for i, s in enumerate(self.stages):
            if not s.kv_transfer:
                continue
            sources = sorted(a for a, b in self.edges() if b == s.stage_id and by_id[a].kv_transfer)
            if len(sources) > 1:
                problems.append(
                    GraphProblem(
                        ("stages", i, "kv_transfer"),
                        f"stage {s.stage_id}: kv_transfer",
                        f"receives KV from stages {sources} (every input edge whose sender has kv_transfer is a KV edge); "
                        "a stage receives KV over at most one input edge",
                    )
                )
        return problems

    def edge_list(self) -> list[Edge]:
        """Every edge of the graph, each once, whichever end (or both) declares it; see :mod:`omni_plugins.config.topology`."""
        from omni_plugins.config.topology import pipeline_edges

        return pipeline_edges(self)

    def topology(self, stage_id: int) -> StageTopology:
        """The edges of one stage and the connector instances they use (what its runtime needs)."""
        from omni_plugins.config.topology import stage_topology

        return stage_topology(self, stage_id)

    def edges(self) -> set[tuple[int, int]]:
        out: set[tuple[int, int]] = set()
        for s in self.stages:
            out |= {(s.stage_id, t) for t in s.output_stages()}
            out |= {(f, s.stage_id) for f in s.input_stages()}
        return out

    def _cycle_problems(self) -> list[GraphProblem]:
        graph: dict[int, set[int]] = {s.stage_id: set() for s in self.stages}
        for a, b in self.edges():
            graph[a].add(b)
        state: dict[int, int] = {}

        def visit(n: int, path: list[int]) -> GraphProblem | None:
            state[n] = 1
            for m in sorted(graph[n]):
                if state.get(m) == 1:
                    cycle = [*path[path.index(m) :], m] if m in path else [n, m]
                    return GraphProblem(self._edge_loc(n, m), "", f"stage graph has a cycle: {' -> '.join(map(str, cycle))}")
                if m not in state:
                    found = visit(m, [*path, m])
                    if found is not None:
                        return found
            state[n] = 2
            return None

        for n in sorted(graph):
            if n not in state:
                found = visit(n, [n])
                if found is not None:
                    return [found]
        return []

    def _edge_loc(self, a: int, b: int) -> Loc:
        """Where the edge ``a -> b`` is written: stage a's ``to_stage_b``, else stage b's ``from_stage_a``."""
        for i, s in enumerate(self.stages):
            if s.stage_id == a:
                for key in s.output_connectors:
                    if _edge_stage(key) == b:
                        return ("stages", i, "output_connectors", key)
        for i, s in enumerate(self.stages):
            if s.stage_id == b:
                for key in s.input_connectors:
                    if _edge_stage(key) == a:
                        return ("stages", i, "input_connectors", key)
        return ("stages",)

    def stage(self, stage_id: int) -> StageConfig:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(f"no stage {stage_id} (stages: {[s.stage_id for s in self.stages]})")

    def stage_connector_config(self, stage_id: int) -> StageConnectorConfig | None:
        """The connector config one stage's runtime needs (None: no connector, transfers are no-ops).

        The stage's output edge decides the connector; a stage with only an input
        edge uses that edge's connector; with neither, ``default_connector``
        applies when other stages are wired, else None.
        """
        s = self.stage(stage_id)
        outputs, inputs = s.output_stages(), s.input_stages()
        if outputs:
            to_stage, instance = min(outputs.items())
        elif inputs:
            to_stage, instance = stage_id + 1, min(inputs.items())[1]
        elif self.default_connector is not None and len(self.stages) > 1:
            to_stage, instance = stage_id + 1, self.default_connector
        else:
            return None
        conn = self.connectors[instance]
        return StageConnectorConfig(
            name=conn.name,
            extra=dict(conn.extra),
            to_stage=to_stage,
            rank_mapping=s.rank_mapping or RankMapping(),
            builder_settings=dict(conn.builder_settings),
        )
