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
the pipeline: a chain, one connector per stage, streaming senders feeding
streaming receivers, KV edges with matching ``kv_transfer`` and ``rank_mapping``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from omni_plugins.config.models import PipelineConfig, StageConfig
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
    upstream: int | None  # the stage this one receives from
    downstream: int | None  # the stage this one sends to
    connector: str | None  # connector instance name (both edges)

    @property
    def stage_id(self) -> int:
        return self.stage.stage_id


@dataclass(frozen=True)
class PipelinePlan:
    """The stages of a validated pipeline in chain order."""

    config: PipelineConfig
    stages: tuple[StagePlan, ...]
    filename: str

    def plan(self, stage_id: int) -> StagePlan:
        for s in self.stages:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def first(self) -> StagePlan:
        return self.stages[0]

    @property
    def last(self) -> StagePlan:
        return self.stages[-1]

    def edges(self) -> list[tuple[StagePlan, StagePlan]]:
        return list(zip(self.stages[:-1], self.stages[1:], strict=True))


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


def build_plan(config: PipelineConfig, *, filename: str = "<pipeline>") -> PipelinePlan:
    """Validate ``synthetic`` blocks and what the runtime needs of the graph; return the chain of stages."""
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

    ups: dict[int, int | None] = {}
    downs: dict[int, int | None] = {}
    conns: dict[int, str | None] = {}
    for s in config.stages:
        ins, outs = s.input_stages(), s.output_stages()
        if len(ins) > 1:
            errors.append(f"{where(s, 'input_connectors')}: 'omni-plugins run' drives chains: a stage has at most one input edge")
        if len(outs) > 1:
            errors.append(f"{where(s, 'output_connectors')}: 'omni-plugins run' drives chains: a stage has at most one output edge")
        instances = set(ins.values()) | set(outs.values())
        if len(instances) > 1:
            errors.append(
                f"{where(s, 'output_connectors')}: a stage runtime has one connector, but this stage's edges use {sorted(instances)}"
            )
        ups[s.stage_id] = next(iter(ins)) if ins else None
        downs[s.stage_id] = next(iter(outs)) if outs else None
        conns[s.stage_id] = next(iter(instances)) if instances else None
    # edges declared on one end only count for both
    for sid, down in list(downs.items()):
        if down is not None and ups.get(down) is None:
            ups[down] = sid
            conns[down] = conns[down] or conns[sid]
    for sid, up in list(ups.items()):
        if up is not None and downs.get(up) is None:
            downs[up] = sid
            conns[up] = conns[up] or conns[sid]
    if errors:
        raise ConfigError("\n".join(errors))
    heads = [sid for sid, up in ups.items() if up is None]
    if len(heads) != 1:
        raise ConfigError(f"{filename}: 'omni-plugins run' needs exactly one first stage (no input edge); found stages {sorted(heads)}")
    chain: list[int] = []
    cur: int | None = heads[0]
    while cur is not None:
        chain.append(cur)
        cur = downs[cur]
    missing = sorted(set(index) - set(chain))
    if missing:
        raise ConfigError(f"{filename}: stages {missing} are not connected to the chain starting at stage {heads[0]}")

    for sid in chain:
        s, spec = config.stage(sid), specs[sid]
        down = downs[sid]
        if down is None:
            if spec.kv is not None:
                errors.append(f"{where(s, 'synthetic.kv')}: the last stage has no next stage to send KV to")
            continue
        d, dspec = config.stage(down), specs[down]
        if not spec.outputs:
            errors.append(f"{where(s, 'synthetic.outputs')}: stage {sid} sends to stage {down} but emits no outputs")
        if spec.send == "stream" and not d.async_chunk:
            errors.append(
                f"{where(s, 'synthetic.send')}: 'stream' needs the receiving stage {down} to have async_chunk: true (or use send: full)"
            )
        if d.worker_type == "generation" and d.async_chunk and "codes.audio" not in {o.name for o in spec.outputs}:
            errors.append(
                f"{where(s, 'synthetic.outputs')}: stage {down} is a 'generation' worker; it only takes chunks with "
                f"'codes.audio', which stage {sid} does not emit"
            )
        if spec.kv is not None:
            for st in (s, d):
                if not st.kv_transfer:
                    errors.append(f"{where(st, 'kv_transfer')}: must be true on both ends of the KV edge {sid} -> {down}")
                rm = st.rank_mapping
                if (rm.from_tp if rm else 1) != s.tp_size or (rm.to_tp if rm else 1) != d.tp_size:
                    errors.append(
                        f"{where(st, 'rank_mapping')}: the KV edge {sid} -> {down} needs rank_mapping "
                        f"{{from_tp: {s.tp_size}, to_tp: {d.tp_size}}} (the two stages' tp_size)"
                    )
            if spec.kv.heads % s.tp_size or spec.kv.heads % d.tp_size:
                errors.append(
                    f"{where(s, 'synthetic.kv.heads')}: {spec.kv.heads} heads do not split over tp_size {s.tp_size} and {d.tp_size}"
                )
        elif d.kv_transfer and dspec.kv is None:
            errors.append(f"{where(d, 'kv_transfer')}: stage {sid} sends no KV (add synthetic.kv to stage {sid})")
    for sid in chain:
        s, spec = config.stage(sid), specs[sid]
        if s.kv_transfer and spec.kv is not None and ups[sid] is not None and specs[ups[sid]].kv is not None:  # type: ignore[index]
            errors.append(f"{where(s, 'synthetic.kv')}: a stage may receive KV or send KV, not both (one rank_mapping per stage)")
    if errors:
        raise ConfigError("\n".join(dict.fromkeys(errors)))
    plans = tuple(StagePlan(config.stage(sid), specs[sid], ups[sid], downs[sid], conns[sid]) for sid in chain)
    return PipelinePlan(config, plans, filename)
