"""A vLLM-Omni stage read into omni-plugins' stage fields.

A stage is first flattened as vLLM-Omni's deploy parser flattens it (``_parse_stage_deploy``):
its own keys, ``runtime.devices`` / ``num_replicas`` / ``env`` (winning over the stage's), then
``engine_args`` (winning, mappings merged). A selected platform's overrides are applied to that
(``_apply_platform_overrides``). The flat keys then map onto omni-plugins' fields; the keys
omni-plugins does not use are kept (``StageConfig.vllm_omni``) and listed in one warning.
"""

from __future__ import annotations

import difflib
from typing import Any

from omni_plugins.config.vllm_omni.reading import Reading, StageRecord
from omni_plugins.config.yamldoc import Loc

Flat = dict[str, tuple[Any, Loc]]

#: keys read into the omni-plugins field of the same name
SAME = (
    "stage_id",
    "model_stage",
    "worker_type",
    "async_chunk",
    "final_output",
    "custom_process_input_func",
    "custom_process_next_stage_input_func",
    "cfg_kv_collect_func",
)
#: vLLM-Omni key -> omni-plugins field
RENAMED = {"tensor_parallel_size": "tp_size", "num_replicas": "replicas"}
#: omni-plugins' own stage fields: a vLLM-Omni file may set them too
OWN = ("rank_mapping", "tp_size", "kv_transfer", "kv_layout", "recv_timeout_s", "replicas", "routing", "synthetic")
#: keys the edge reader takes
EDGE_KEYS = ("input_connectors", "output_connectors", "engine_input_source")
#: prefill / decode flags the replica reader takes
PD_FLAGS = ("is_prefill_only", "is_decode_only")
#: runtime keys vLLM-Omni lifts onto the stage (they win over the stage's own)
_RUNTIME_LIFTED = ("devices", "num_replicas", "env")
#: mappings a platform override merges into the stage's instead of replacing
_DEEP = frozenset({"default_sampling_params", "default_pooling_params", "subtalker_sampling_params", "engine_extras", "engine_args"})

#: every key omni-plugins reads from a vLLM-Omni stage (for near-miss hints)
READ_KEYS = (*SAME, *RENAMED, *OWN, *EDGE_KEYS, *PD_FLAGS, "omni_kv_config")


def flatten(stage: dict[Any, Any], loc: Loc) -> Flat:
    """The stage's keys as vLLM-Omni's deploy parser sees them, each with where it was written."""
    flat: Flat = {}
    for k, v in stage.items():
        if k not in ("engine_args", "runtime"):
            flat[str(k)] = (v, (*loc, k))
    runtime = stage.get("runtime")
    if isinstance(runtime, dict):
        for k, v in runtime.items():
            flat[str(k) if k in _RUNTIME_LIFTED else f"runtime.{k}"] = (v, (*loc, "runtime", k))
    elif runtime is not None:
        flat["runtime"] = (runtime, (*loc, "runtime"))
    engine = stage.get("engine_args")
    if isinstance(engine, dict):
        for k, v in engine.items():
            at = (*loc, "engine_args", k)
            old = flat.get(str(k))
            flat[str(k)] = (_merged(old[0], v), at) if old is not None and isinstance(old[0], dict) and isinstance(v, dict) else (v, at)
    elif engine is not None:
        flat["engine_args"] = (engine, (*loc, "engine_args"))
    return flat


def _merged(base: dict[Any, Any], update: dict[Any, Any]) -> dict[Any, Any]:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merged(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def apply_platform(flat: Flat, override: dict[Any, Any], loc: Loc) -> None:
    """One stage entry of a platform section applied as vLLM-Omni applies it (``engine_args`` form or flat)."""
    if isinstance(override.get("engine_args"), dict):
        items = [(k, v, (*loc, "engine_args", k)) for k, v in override["engine_args"].items()]
        runtime = override.get("runtime")
        if isinstance(runtime, dict):
            items += [(k, runtime[k], (*loc, "runtime", k)) for k in _RUNTIME_LIFTED if k in runtime]
    else:
        items = [(k, v, (*loc, k)) for k, v in override.items() if k != "stage_id"]
    for k, v, at in items:
        key = str(k)
        old = flat.get(key)
        if key in _DEEP and old is not None and isinstance(old[0], dict) and isinstance(v, dict):
            flat[key] = ({**old[0], **v}, at)
        else:
            flat[key] = (v, at)


def read_stage(record: StageRecord, flat: Flat, reading: Reading, top_async: tuple[Any, Loc] | None) -> Flat:
    """Fill ``record`` with the flat keys omni-plugins uses; returns the edge keys (for the edge reader)."""
    edges: Flat = {}
    for key, (value, at) in flat.items():
        if key in SAME or key in OWN:
            record.set(key, value, at)
        elif key in RENAMED:
            if RENAMED[key] in flat:
                record.unused[key] = (value, at)  # the omni-plugins field is set too, and wins
            else:
                record.set(RENAMED[key], value, at)
        elif key in EDGE_KEYS:
            edges[key] = (value, at)
        elif key in PD_FLAGS:
            record.flags[key] = (value, at)
        elif key == "omni_kv_config" and isinstance(value, dict):
            _read_kv(record, value, at)
        else:
            record.unused[key] = (value, at)
            near = difflib.get_close_matches(key, READ_KEYS, n=1, cutoff=0.85)
            if near:
                reading.near_misses.append(f"{reading.where(at)}: {key!r} is not read (did you mean {near[0]!r}?)")
    _async_chunk(record, flat, reading, top_async)
    return edges


def _read_kv(record: StageRecord, kv: dict[Any, Any], at: Loc) -> None:
    """``omni_kv_config.need_send_cache`` / ``need_recv_cache``: the stage's KV travels on its edges (``kv_transfer``)."""
    flags = [(k, kv[k]) for k in ("need_send_cache", "need_recv_cache") if k in kv]
    for k, v in kv.items():
        if k not in ("need_send_cache", "need_recv_cache"):
            record.unused[f"omni_kv_config.{k}"] = (v, (*at, k))
    if flags and "kv_transfer" not in record.native:
        on = [k for k, v in flags if v is True or (isinstance(v, str) and v.strip().lower() == "true")]
        record.set("kv_transfer", bool(on), (*at, on[0] if on else flags[0][0]))


def _async_chunk(record: StageRecord, flat: Flat, reading: Reading, top: tuple[Any, Loc] | None) -> None:
    """vLLM-Omni's rule: a stage streams when the pipeline-wide ``async_chunk`` is on and the stage does not say false.

    The pipeline-wide value defaults to true in the deploy layout; a legacy file without one keeps each stage's own.
    """
    if top is None:
        if reading.legacy:
            return
        top = (True, record.loc)
    value, at = top
    if not isinstance(value, bool):
        return  # reported once for the file by the top-level reader
    own = flat.get("async_chunk")
    if own is not None and (own[0] is False or (isinstance(own[0], str) and own[0].strip().lower() == "false")):
        return  # the stage's own false stands
    if own is not None and not value:
        record.set("async_chunk", False, at)  # the pipeline-wide false wins over the stage's true
    elif own is None:
        record.set("async_chunk", value, at)
