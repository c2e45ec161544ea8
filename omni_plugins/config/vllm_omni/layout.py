"""A vLLM-Omni stage config file read into omni-plugins' pipeline fields.

Both of vLLM-Omni's layouts: legacy (``stage_args``, ``runtime: {connectors, edges}``, stage
settings under ``engine_args`` and ``runtime``) and deploy (``connectors``, ``edges`` and flat
``stages`` beside pipeline-wide engine settings, ``platforms``; overlays are merged before this).
The result is the data of a native file plus, for every value, where it was read from; settings
omni-plugins does not use are kept (the ``vllm_omni`` fields) and listed in one warning.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from omni_plugins.config.origins import Origins
from omni_plugins.config.vllm_omni import stages as stage_reader
from omni_plugins.config.vllm_omni.connectors import Translated, translate_connector
from omni_plugins.config.vllm_omni.edges import EdgeReader, stage_number
from omni_plugins.config.vllm_omni.reading import Reading, StageRecord
from omni_plugins.config.vllm_omni.replicas import ROLES, read_replicas
from omni_plugins.config.yamldoc import Loc
from omni_plugins.errors import ConfigError

logger = logging.getLogger(__name__)

_TO_STAGE = re.compile(r"^to_stage_(\d+)$")

#: top-level keys of vLLM-Omni's layouts (either marks a file as vLLM-Omni's)
TOP_KEYS = frozenset(
    {
        "stage_args",
        "runtime",
        "base_config",
        "platforms",
        "async_chunk",
        "edges",
        "pipeline",
        "session_mode",
        "model_runner",
        "active_stream_window",
        "duplex_session",
        "trust_remote_code",
        "distributed_executor_backend",
        "dtype",
        "quantization",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "data_parallel_size",
        "pipeline_parallel_size",
        "custom_voice_dir",
        "pd_prefill_pick_strategy",
        "pd_decode_pick_strategy",
    }
)
#: stage keys only vLLM-Omni files have (either marks a file as vLLM-Omni's)
STAGE_KEYS = frozenset(
    {
        "engine_args",
        "engine_extras",
        "runtime",
        "devices",
        "num_replicas",
        "env",
        "engine_input_source",
        "stage_type",
        "default_sampling_params",
        "default_pooling_params",
        "is_comprehension",
        "final_output_type",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "enforce_eager",
        "trust_remote_code",
        "enable_prefix_caching",
        "async_scheduling",
        "hf_overrides",
        "is_prefill_only",
        "is_decode_only",
        "prompt_expand_func",
        "omni_kv_config",
        "kv_transfer_config",
    }
)
#: top-level keys omni-plugins reads from a vLLM-Omni file (the others are kept, not used)
_READ_TOP = ("stages", "stage_args", "connectors", "edges", "async_chunk", "default_connector", "platforms", "vllm_omni", *(k for _, k in ROLES.values()))


def is_vllm_omni(data: dict[Any, Any]) -> bool:
    """Whether a file is in one of vLLM-Omni's layouts (by its top-level or stage keys)."""
    if any(k in TOP_KEYS for k in data):
        return True
    stages = data.get("stages")
    return isinstance(stages, list) and any(isinstance(s, dict) and any(k in STAGE_KEYS for k in s) for s in stages)


def read_vllm_omni(data: dict[Any, Any], origins: Origins, *, platform: str | None) -> dict[str, Any]:
    """The native pipeline data of a vLLM-Omni file; ``origins.moves`` gets where each value was read from.

    Raises :class:`ConfigError` with one line per problem (file, line, field).
    """
    reading = Reading(origins.main.filename, origins.merged_where, "stage_args" in data or isinstance(data.get("runtime"), dict))
    runtime: dict[Any, Any] = data["runtime"] if isinstance(data.get("runtime"), dict) else {}
    # vLLM-Omni reads runtime.connectors / runtime.edges when given, else the deploy layout's top-level ones
    connectors_at: Loc = ("runtime", "connectors") if "connectors" in runtime else ("connectors",)
    edges_at: Loc = ("runtime", "edges") if "edges" in runtime else ("edges",)
    _top_level(data, runtime, connectors_at, edges_at, reading)

    stages_key = "stage_args" if "stage_args" in data else "stages"
    if "stage_args" in data and "stages" in data:
        reading.problem(("stages",), "both 'stages' and 'stage_args' are given; a file has one stage list")
    records, edge_keys = _read_stages(data.get(stages_key), stages_key, _platform_section(data, platform, reading), _async_chunk(data, reading), reading)

    defined_raw = _get(data, connectors_at)
    defined = {str(k): (v, (*connectors_at, k)) for k, v in defined_raw.items()} if isinstance(defined_raw, dict) else {}
    reader = EdgeReader(reading, defined, ".".join(map(str, connectors_at)))
    _read_edges(reader, records, edge_keys, _get(data, edges_at), edges_at, reading)
    records = read_replicas(records, {key: (data[key], (key,)) for _, key in ROLES.values() if key in data}, reading)
    _kv_rank_mapping(records)

    native: dict[str, Any] = {}
    moves: dict[Loc, Loc] = {("connectors",): connectors_at, ("stages",): (stages_key,)}
    if isinstance(defined_raw, dict) or defined_raw is None:
        native["connectors"] = _connectors(reader, defined, reading, moves)
    else:
        native["connectors"] = defined_raw  # the model reports the wrong type
    raw_stages = data.get(stages_key)
    if raw_stages is not None:
        native["stages"] = _assemble(records, moves) if isinstance(raw_stages, list) else raw_stages
    if "default_connector" in data:
        native["default_connector"] = data["default_connector"]
    own = data.get("vllm_omni")
    kept = {**(own if isinstance(own, dict) else {}), **reading.unused}
    if kept:
        native["vllm_omni"] = kept
    if reading.problems:
        raise ConfigError("\n".join(reading.problems))
    origins.moves.update(moves)
    _warn(reading, records)
    return native


def _read_stages(
    raw_stages: Any, stages_key: str, section: tuple[dict[Any, Any], Loc] | None, top_async: tuple[Any, Loc] | None, reading: Reading
) -> tuple[list[StageRecord], list[dict[str, tuple[Any, Loc]]]]:
    """Each stage flattened, its platform overrides applied, its fields read; with its edge keys for the edge reader."""
    records: list[StageRecord] = []
    edge_keys: list[dict[str, tuple[Any, Loc]]] = []
    for i, stage in enumerate(raw_stages if isinstance(raw_stages, list) else []):
        loc: Loc = (stages_key, i)
        if not isinstance(stage, dict):
            records.append(StageRecord(loc, None, raw=stage, passthrough=True))
            edge_keys.append({})
            continue
        flat = stage_reader.flatten(stage, loc)
        for override, at in _platform_overrides(section, stage.get("stage_id")):
            stage_reader.apply_platform(flat, override, at)
        record = StageRecord(loc, flat.get("stage_id", (None,))[0])
        edge_keys.append(stage_reader.read_stage(record, flat, reading, top_async))
        records.append(record)
    return records, edge_keys


def _read_edges(
    reader: EdgeReader,
    records: list[StageRecord],
    edge_keys: list[dict[str, tuple[Any, Loc]]],
    runtime_edges: Any,
    edges_at: Loc,
    reading: Reading,
) -> None:
    """vLLM-Omni's order: the ends the stages write, then ``runtime.edges`` / ``edges``, then ``engine_input_source``."""
    for record, keys in zip(records, edge_keys, strict=True):
        for kind in ("input_connectors", "output_connectors"):
            if kind in keys:
                reader.declared(record, kind, *keys[kind])
    by_id = {n: r for r in records if (n := stage_number(r.stage_id)) is not None}
    edge_list = runtime_edges if isinstance(runtime_edges, list) else []
    for n, edge in enumerate(edge_list):
        if isinstance(edge, dict) and edge.get("from") is not None and edge.get("to") is not None:
            reader.automatic(edge["from"], edge["to"], (*edges_at, n), by_id)
    for key in dict.fromkeys(k for e in edge_list if isinstance(e, dict) for k in e if k not in ("from", "to")):
        reading.unused[f"{'.'.join(map(str, edges_at))}[].{key}"] = [e.get(key) if isinstance(e, dict) else None for e in edge_list]
    for record, keys in zip(records, edge_keys, strict=True):
        if "engine_input_source" in keys:
            sources, at = keys["engine_input_source"]
            if not isinstance(sources, list):
                reading.problem(at, f"engine_input_source is a list of the stage ids this stage reads from, got {sources!r}")
                continue
            for n, source in enumerate(sources):
                reader.automatic(source, record.stage_id, (*at, n), by_id)


def _get(data: dict[Any, Any], loc: Loc) -> Any:
    node: Any = data
    for p in loc:
        node = node.get(p) if isinstance(node, dict) else None
    return node


def _top_level(data: dict[Any, Any], runtime: dict[Any, Any], connectors_at: Loc, edges_at: Loc, reading: Reading) -> None:
    """Pipeline-wide keys omni-plugins does not use: kept, listed."""
    for key, value in data.items():
        if key == "runtime" and isinstance(value, dict):
            for k, v in value.items():
                if ("runtime", k) not in (connectors_at, edges_at):
                    reading.unused[f"runtime.{k}"] = v
        elif key not in _READ_TOP or (key == "connectors" and connectors_at != ("connectors",)) or (key == "edges" and edges_at != ("edges",)):
            reading.unused[str(key)] = value


def _async_chunk(data: dict[Any, Any], reading: Reading) -> tuple[Any, Loc] | None:
    if "async_chunk" not in data:
        return None
    value = data["async_chunk"]
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    if not isinstance(value, bool):
        reading.problem(("async_chunk",), f"async_chunk must be true or false, got {value!r}")
        return None
    return value, ("async_chunk",)


def _platform_section(data: dict[Any, Any], platform: str | None, reading: Reading) -> tuple[dict[Any, Any], Loc] | None:
    platforms = data.get("platforms")
    if platforms is None:
        return None
    if not isinstance(platforms, dict):
        reading.problem(("platforms",), f"platforms maps a platform name (npu, rocm, xpu ...) to its overrides, got {platforms!r}")
        return None
    names = ", ".join(map(str, platforms))
    if platform is None:
        reading.notes.append(f"{reading.where(('platforms',))}: sections {names} not applied: choose one with --platform")
        return None
    section = platforms.get(platform.lower())
    if section is None:
        reading.notes.append(f"{reading.where(('platforms',))}: no section for platform {platform!r} (sections: {names}): the file is read as written")
        return None
    if not isinstance(section, dict):
        reading.problem(("platforms", platform.lower()), f"a platform section is a mapping with 'stages', got {section!r}")
        return None
    for key, value in section.items():
        if key != "stages":
            reading.unused[f"platforms.{platform.lower()}.{key}"] = value
    return section, ("platforms", platform.lower())


def _platform_overrides(section: tuple[dict[Any, Any], Loc] | None, stage_id: Any) -> list[tuple[dict[Any, Any], Loc]]:
    if section is None or stage_number(stage_id) is None:
        return []
    body, at = section
    entries = body.get("stages")
    return [
        (entry, (*at, "stages", n))
        for n, entry in enumerate(entries if isinstance(entries, list) else [])
        if isinstance(entry, dict) and stage_number(entry.get("stage_id")) == stage_number(stage_id)
    ]


def _kv_rank_mapping(records: list[StageRecord]) -> None:
    """A KV edge between stages of different TP sizes gets the rank mapping they imply, on both ends, unless set."""
    by_id = {n: r for r in records if (n := stage_number(r.stage_id)) is not None}

    def tp(r: StageRecord) -> int:
        value = r.native.get("tp_size", 1)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    for sender in records:
        outputs = sender.native.get("output_connectors")
        targets = {int(m.group(1)) for k in outputs if (m := _TO_STAGE.match(str(k)))} if isinstance(outputs, dict) else set()
        n = stage_number(sender.stage_id)
        for receiver in records:
            inputs = receiver.native.get("input_connectors")
            if isinstance(inputs, dict) and f"from_stage_{n}" in inputs:
                targets.add(stage_number(receiver.stage_id) or -1)
        for t in sorted(targets):
            found = by_id.get(t)
            if found is None or sender.native.get("kv_transfer") is not True or found.native.get("kv_transfer") is not True:
                continue
            mapping = {"from_tp": tp(sender), "to_tp": tp(found)}
            if mapping != {"from_tp": 1, "to_tp": 1}:
                for r in (sender, found):
                    if "rank_mapping" not in r.native:
                        r.set("rank_mapping", mapping, r.moves.get(("tp_size",), r.loc))


def _connectors(reader: EdgeReader, defined: dict[str, tuple[Any, Loc]], reading: Reading, moves: dict[Loc, Loc]) -> dict[str, Any]:
    """Every connector instance (defined, inline, automatic) translated through the plugins' declarations."""
    out: dict[str, Any] = {}
    for instance, (definition, at) in [*defined.items(), *reader.made.items()]:
        moves[("connectors", instance)] = at
        if not isinstance(definition, dict):
            out[instance] = definition  # the connector model reports it
            continue
        extra = definition.get("extra")
        extra = {} if extra is None else extra
        try:
            t = translate_connector(definition.get("name"), extra)
        except Exception as exc:
            if instance in reader.used:
                reading.problem((*at, "name"), str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")
            else:
                reading.notes.append(f"{reading.where(at)}: connector {instance!r} is used by no edge and is not checked: {exc}")
            continue
        out[instance] = _native_connector(definition, t, extra)
        moves[("connectors", instance, "name")] = (*at, "name")
        moves[("connectors", instance, "extra")] = (*at, "extra")
        moves[("connectors", instance, "builder_settings")] = (*at, "extra")
        for ours, theirs in t.renamed.items():
            moves[("connectors", instance, "extra", ours)] = (*at, "extra", theirs)
        for key, why in t.unused:
            reading.unused_connector_keys.append(f"{instance}.{key} ({why})")
        for key, hint in t.near:
            reading.near_misses.append(
                f"{reading.where((*at, 'extra', key))}: {key!r} is not a setting of {t.name!r} and is left to the payload builders "
                f"(did you mean {hint!r}?)"
            )
    return out


def _native_connector(definition: dict[Any, Any], t: Translated, extra: Any) -> dict[str, Any]:
    native: dict[str, Any] = {"name": t.name, "extra": t.extra}
    if isinstance(extra, dict) and extra:
        native["builder_settings"] = dict(extra)
    for key, value in definition.items():
        if key not in ("name", "extra"):
            native[key] = value  # the connector model reports unknown keys
    return native


def _assemble(records: list[StageRecord], moves: dict[Loc, Loc]) -> list[Any]:
    stages: list[Any] = []
    for j, record in enumerate(records):
        moves[("stages", j)] = record.loc
        if record.passthrough:
            stages.append(record.raw)
            continue
        stage = dict(record.native)
        if record.unused:
            stage["vllm_omni"] = {k: v for k, (v, _) in record.unused.items()}
        for rel, at in record.moves.items():
            moves[("stages", j, *rel)] = at
        stages.append(stage)
    return stages


def _warn(reading: Reading, records: list[StageRecord]) -> None:
    parts: list[str] = []
    if reading.unused:
        parts.append(", ".join(reading.unused))
    by_key: dict[str, list[str]] = {}
    for record in records:
        for key in record.unused:
            if key != "replica_stages":  # kept by the reader (folded replicas' settings), not a setting of the file
                by_key.setdefault(key, []).append(str(record.stage_id))
    if by_key:
        parts.append(", ".join(f"{k} (stage {', '.join(ids)})" for k, ids in by_key.items()))
    if reading.unused_connector_keys:
        parts.append("connectors: " + ", ".join(reading.unused_connector_keys))
    if parts:
        logger.warning(
            "%s: vLLM-Omni settings omni-plugins does not use (kept in the config's vllm_omni and builder_settings fields): %s",
            reading.filename,
            "; ".join(parts),
        )
    for note in [*reading.notes, *reading.near_misses]:
        logger.warning("%s", note)
