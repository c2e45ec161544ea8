"""The ``synthetic`` block of a stage: what a stand-in model emits, validated with pydantic.

``omni-plugins run`` replaces every stage's model with a synthetic one. Its
outputs are described per stage in the pipeline YAML::

    synthetic:
      steps: 16                 # output steps (decode steps) per request
      send: stream              # stream: one chunk per step; full: one payload when the request ends
      outputs:                  # tensors emitted per step; dim 0 is the token dim
        - {name: hidden.states, shape: [1, 2048], dtype: bfloat16}
      kv: {layers: 4, heads: 8, head_dim: 64, tokens: 48, block_size: 16, dtype: bfloat16}
      seed: 0

Errors name the file, the stage and the field, like the rest of the loader.
The cross-stage checks (:func:`build_plan`) make sure the runtime can carry
the pipeline: one connected graph (any DAG: fan-in, fan-out, replicas),
streaming senders feeding streaming receivers, every destination getting
something, KV edges with matching ``kv_transfer`` and ``rank_mapping``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from omni_plugins.config.models import PipelineConfig, StageConfig
from omni_plugins.config.topology import Edge
from omni_plugins.errors import ConfigError

#: dtype names accepted in ``outputs[].dtype`` / ``kv.dtype``
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")
#: sections the synthetic model writes itself
RESERVED_SECTIONS = ("meta", "trace")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Typed(_Strict):
    """A spec with a ``dtype`` field naming one of :data:`DTYPES`."""

    dtype: str

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPES:
            raise ValueError(f"unknown dtype {v!r}; use one of {', '.join(DTYPES)}")
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize


class TensorSpec(_Typed):
    """One tensor emitted per step, under ``section.field`` of the payload."""

    name: str = Field(description="'section.field', e.g. 'hidden.states' or 'codes.audio'")
    shape: list[PositiveInt] = Field(min_length=2, description="per-step shape; dim 0 (tokens) is concatenated across steps")
    dtype: str = Field(default="bfloat16", description=f"one of {', '.join(DTYPES)}")
    to: list[int] | None = Field(
        default=None, min_length=1, description="the stages this tensor goes to (default: every output edge); what each destination needs"
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"name must look like 'section.field', got {v!r}")
        if v.split(".", 1)[0] in RESERVED_SECTIONS:
            raise ValueError(f"section {v.split('.', 1)[0]!r} is reserved for the synthetic model's own fields")
        return v

    @property
    def step_nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.itemsize


class KVSpec(_Typed):
    """A KV cache the stage sends to the next stage when a request finishes (every TP rank sends its heads)."""

    layers: PositiveInt = 2
    heads: PositiveInt = Field(default=8, description="total KV heads (split across the sending stage's TP ranks)")
    head_dim: PositiveInt = 64
    tokens: PositiveInt = Field(default=32, description="sequence length per request")
    block_size: PositiveInt = 16
    dtype: str = "bfloat16"

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (all heads) K and V of one request."""
        return 2 * self.layers * self.tokens * self.heads * self.head_dim * self.itemsize


class SyntheticSpec(_Strict):
    """What one stage's synthetic model emits."""

    steps: PositiveInt = Field(default=8, description="output steps per request")
    send: Literal["stream", "full"] = Field(
        default="stream", description="stream: one chunk per step; full: the accumulated steps as one payload at the end"
    )
    outputs: list[TensorSpec] = Field(default_factory=list, description="tensors emitted per step")
    kv: KVSpec | None = Field(default=None, description="send a KV cache to the next stage at the end of each request")
    seed: int = Field(default=0, description="mixed into every generated value")
    step_ms: float = Field(default=0.0, ge=0, le=10_000, description="simulated compute time per model step")

    @model_validator(mode="after")
    def _unique(self) -> SyntheticSpec:
        names = [o.name for o in self.outputs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate output names {dupes}")
        return self

    def step_nbytes(self) -> int:
        return sum(o.step_nbytes for o in self.outputs)


@dataclass(frozen=True)
class StagePlan:
    """One stage as ``omni-plugins run`` drives it."""

    stage: StageConfig
    synthetic: SyntheticSpec
    inputs: tuple[Edge, ...] = ()  # the edges this stage receives on
    outputs: tuple[Edge, ...] = ()  # the edges this stage sends on

    @property
    def stage_id(self) -> int:
        return self.stage.stage_id

    @property
    def replicas(self) -> int:
        return self.stage.replicas

    @property
    def upstreams(self) -> tuple[int, ...]:
        return tuple(e.from_stage for e in self.inputs)

    @property
    def downstreams(self) -> tuple[int, ...]:
        return tuple(e.to_stage for e in self.outputs)

    @property
    def kv_input(self) -> Edge | None:
        """The input edge KV arrives on (when its sender sends KV)."""
        return next((e for e in self.inputs if e.kv), None)

    def outputs_to(self, to_stage: int) -> list[TensorSpec]:
        """The outputs this stage sends to ``to_stage`` (``outputs[].to``; all of them by default)."""
        return [o for o in self.synthetic.outputs if o.to is None or to_stage in o.to]

    def connectors(self) -> set[str]:
        """Connector instances of this stage's edges (payloads, and KV on KV edges)."""
        return {name for e in (*self.inputs, *self.outputs) for name in ((e.connector, e.kv_connector) if e.kv else (e.connector,))}


@dataclass(frozen=True)
class PipelinePlan:
    """The stages of a validated pipeline in dependency order (every stage after the stages it receives from)."""

    config: PipelineConfig
    stages: tuple[StagePlan, ...]
    filename: str

    def plan(self, stage_id: int) -> StagePlan:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def heads(self) -> tuple[StagePlan, ...]:
        """Stages with no input edge: a request enters the pipeline at each of them."""
        return tuple(s for s in self.stages if not s.inputs)

    @property
    def first(self) -> StagePlan:
        return self.stages[0]

    @property
    def last(self) -> StagePlan:
        return self.stages[-1]

    def edges(self) -> list[Edge]:
        return [e for s in self.stages for e in s.outputs]

    def connectors(self) -> set[str]:
        """Every connector instance an edge uses."""
        return {name for s in self.stages for name in s.connectors()}


def _where(filename: str, index: int, stage: StageConfig, field: str) -> str:
    return f"{filename}: stages[{index}] (stage {stage.stage_id}).{field}"


def parse_synthetic(stage: StageConfig, *, filename: str, index: int) -> SyntheticSpec:
    """Validate one stage's ``synthetic`` block (a missing block means: receive only, emit nothing)."""
    raw: Any = stage.synthetic if stage.synthetic is not None else {"steps": 1}
    try:
        return SyntheticSpec.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                msg = f"unknown field {str(err['loc'][-1])!r}"
            lines.append(f"{_where(filename, index, stage, 'synthetic' + ('.' + loc if loc else ''))}: {msg}")
        raise ConfigError("\n".join(lines)) from None


def _dependency_order(stages: list[int], edges: list[Edge]) -> list[int]:
    """Stage ids, every stage after its senders (the graph is acyclic: the loader checked), ties by id."""
    incoming = {sid: 0 for sid in stages}
    for e in edges:
        incoming[e.to_stage] += 1
    ready = sorted(sid for sid, n in incoming.items() if n == 0)
    order: list[int] = []
    while ready:
        sid = ready.pop(0)
        order.append(sid)
        for e in edges:
            if e.from_stage == sid:
                incoming[e.to_stage] -= 1
                if incoming[e.to_stage] == 0:
                    ready.append(e.to_stage)
                    ready.sort()
    return order


def _components(stages: list[int], edges: list[Edge]) -> list[list[int]]:
    """The stages grouped by (undirected) connectivity."""
    parent = {sid: sid for sid in stages}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in edges:
        parent[find(e.from_stage)] = find(e.to_stage)
    groups: dict[int, list[int]] = {}
    for sid in stages:
        groups.setdefault(find(sid), []).append(sid)
    return sorted(sorted(g) for g in groups.values())


def build_plan(config: PipelineConfig, *, filename: str = "<pipeline>") -> PipelinePlan:
    """Validate ``synthetic`` blocks and what the runtime needs of the graph; return the stages in dependency order."""
    index = {s.stage_id: i for i, s in enumerate(config.stages)}
    errors: list[str] = []
    specs: dict[int, SyntheticSpec] = {}
    for s in config.stages:
        try:
            specs[s.stage_id] = parse_synthetic(s, filename=filename, index=index[s.stage_id])
        except ConfigError as exc:
            errors.append(str(exc))
    if errors:
        raise ConfigError("\n".join(errors))

    def where(s: StageConfig, field: str) -> str:
        return _where(filename, index[s.stage_id], s, field)

    edges = config.edge_list()
    ids = [s.stage_id for s in config.stages]
    groups = _components(ids, edges)
    if len(groups) > 1:
        raise ConfigError(
            f"{filename}: 'omni-plugins run' drives one connected pipeline; these groups of stages share no edge: "
            + ", ".join(str(g) for g in groups)
        )
    plans = {
        sid: StagePlan(config.stage(sid), specs[sid], tuple(e for e in edges if e.to_stage == sid), tuple(e for e in edges if e.from_stage == sid))
        for sid in ids
    }
    for p in plans.values():
        errors += _stage_errors(p, plans, where)
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    return PipelinePlan(config, tuple(plans[sid] for sid in _dependency_order(ids, edges)), filename)


def _stage_errors(p: StagePlan, plans: dict[int, StagePlan], where: Any) -> list[str]:
    """What ``run`` cannot carry about stage ``p``'s output edges, KV and ``outputs[].to``."""
    errors: list[str] = []
    s, spec, sid = p.stage, p.synthetic, p.stage_id
    for i, o in enumerate(spec.outputs):
        for to in o.to or ():
            if to not in p.downstreams:
                errors.append(f"{where(s, f'synthetic.outputs.{i}.to')}: stage {sid} has no output edge to stage {to} (edges to: {list(p.downstreams)})")
    if not p.outputs and spec.kv is not None:
        errors.append(f"{where(s, 'synthetic.kv')}: the last stage has no next stage to send KV to")
    for e in p.outputs:
        ds = plans[e.to_stage].stage
        routed = p.outputs_to(e.to_stage)
        if not spec.outputs:
            errors.append(f"{where(s, 'synthetic.outputs')}: stage {sid} sends to stage {e.to_stage} but emits no outputs")
        elif not routed:
            errors.append(f"{where(s, 'synthetic.outputs')}: no output goes to stage {e.to_stage} (outputs[].to leaves it out)")
        if spec.send == "stream" and not ds.async_chunk:
            errors.append(
                f"{where(s, 'synthetic.send')}: 'stream' needs the receiving stage {e.to_stage} to have async_chunk: true (or use send: full)"
            )
        if ds.worker_type == "generation" and ds.async_chunk and routed and "codes.audio" not in {o.name for o in routed}:
            errors.append(
                f"{where(s, 'synthetic.outputs')}: stage {e.to_stage} is a 'generation' worker; it only takes chunks with "
                f"'codes.audio', which stage {sid} does not send it"
            )
    if spec.kv is not None and p.outputs:
        kv_edges = [e for e in p.outputs if e.kv]
        if not s.kv_transfer or not kv_edges:
            for e in p.outputs:
                for st in (s, plans[e.to_stage].stage):
                    if not st.kv_transfer:
                        errors.append(f"{where(st, 'kv_transfer')}: must be true on both ends of the KV edge {sid} -> {e.to_stage}")
        for e in kv_edges:
            d: StageConfig = plans[e.to_stage].stage
            for st in (s, d):
                rm = st.rank_mapping
                if (rm.from_tp if rm else 1) != s.tp_size or (rm.to_tp if rm else 1) != d.tp_size:
                    errors.append(
                        f"{where(st, 'rank_mapping')}: the KV edge {sid} -> {d.stage_id} needs rank_mapping "
                        f"{{from_tp: {s.tp_size}, to_tp: {d.tp_size}}} (the two stages' tp_size)"
                    )
            if spec.kv.heads % s.tp_size or spec.kv.heads % d.tp_size:
                errors.append(
                    f"{where(s, 'synthetic.kv.heads')}: {spec.kv.heads} heads do not split over tp_size {s.tp_size} and {d.tp_size}"
                )
    kv_in = p.kv_input
    if s.kv_transfer and spec.kv is None and (kv_in is None or plans[kv_in.from_stage].synthetic.kv is None):
        ups = [kv_in.from_stage] if kv_in is not None else list(p.upstreams)
        if ups:
            errors.append(f"{where(s, 'kv_transfer')}: stage {ups[0]} sends no KV (add synthetic.kv to stage {ups[0]})")
        else:
            errors.append(f"{where(s, 'kv_transfer')}: stage {sid} neither sends KV (synthetic.kv) nor has an input edge to receive it on")
    if s.kv_transfer and spec.kv is not None and kv_in is not None and plans[kv_in.from_stage].synthetic.kv is not None:
        errors.append(f"{where(s, 'synthetic.kv')}: a stage may receive KV or send KV, not both (one rank_mapping per stage)")
    return errors
