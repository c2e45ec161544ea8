"""Prefill / decode stages of a vLLM-Omni file read as replicas of one omni-plugins stage.

vLLM-Omni's PD disaggregation runs K prefill stages (``is_prefill_only``) and N decode stages
(``is_decode_only``), each its own ``stage_id``; a decode stage lists every prefill stage in
``engine_input_source``, and the orchestrator sends each request to one of them, picked by
``pd_prefill_pick_strategy`` / ``pd_decode_pick_strategy`` (``round_robin`` or
``least_inflight``). That is what omni-plugins calls replicas: K prefill stages become one stage
with ``replicas: K`` and ``routing`` set from the strategy (likewise the decode stages), and the
edges to and from them become one edge. (Read as separate stages, a decode stage would wait for
every prefill stage: a fan-in.)

This holds when the stages are alike in everything omni-plugins reads (model stage, builders, TP
size, KV, their edges' connectors); otherwise reading them as replicas would change what runs, and
it is an error naming the first difference. Their unused vLLM-Omni settings (devices, ports) are
kept per stage under ``vllm_omni.replica_stages``.
"""

from __future__ import annotations

import re
from typing import Any

from omni_plugins.config.models import RoutingPolicy
from omni_plugins.config.vllm_omni.edges import stage_number
from omni_plugins.config.vllm_omni.reading import Reading, StageRecord
from omni_plugins.config.yamldoc import Loc

#: role -> (the stage flag, the top-level pick strategy)
ROLES = {"prefill": ("is_prefill_only", "pd_prefill_pick_strategy"), "decode": ("is_decode_only", "pd_decode_pick_strategy")}
STRATEGIES: tuple[RoutingPolicy, ...] = ("round_robin", "least_inflight")
_EDGE_KEY = re.compile(r"^(from|to)_stage_(\d+)$")
#: fields compared between stages read as replicas (besides their edges)
_IGNORED = ("stage_id", "replicas", "routing", "input_connectors", "output_connectors")


def _true(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def read_replicas(records: list[StageRecord], strategies: dict[str, tuple[Any, Loc]], reading: Reading) -> list[StageRecord]:
    """The stage records with every group of prefill (decode) stages folded into its first stage."""
    for role, (flag, key) in ROLES.items():
        strategy = strategies.get(key)
        if strategy is not None and strategy[0] not in STRATEGIES:
            reading.problem(strategy[1], f"must be one of {', '.join(STRATEGIES)}, got {strategy[0]!r}")
            strategy = None
        group = [r for r in records if _true(r.flags.get(flag, (False,))[0]) and stage_number(r.stage_id) is not None]
        if strategy is not None and not group:
            reading.notes.append(f"{reading.where(strategy[1])}: not used: no stage has {flag}: true")
        if len(group) > 1 and _alike(group, role, flag, reading):
            records = _fold(records, group)
        if strategy is not None and group:
            head = group[0]
            replicas = head.native.get("replicas", 1)
            if isinstance(replicas, int) and replicas > 1 and "routing" not in head.native:
                head.set("routing", strategy[0], strategy[1])
            elif not (isinstance(replicas, int) and replicas > 1):
                reading.notes.append(f"{reading.where(strategy[1])}: not used: there is one {role} stage ({head.label()})")
    return records


def _alike(group: list[StageRecord], role: str, flag: str, reading: Reading) -> bool:
    head = group[0]
    ids = ", ".join(str(r.stage_id) for r in group)
    for other in group[1:]:
        difference = _difference(head, other)
        if difference is not None:
            field, at = difference
            reading.problem(
                at,
                f"stages {ids} are {role} stages ({flag}), which omni-plugins reads as replicas of stage {head.stage_id} "
                f"(each request goes to one of them); they must agree on what omni-plugins uses, and {other.label()} "
                f"differs from {head.label()} in {field}",
            )
            return False
    return True


def _difference(a: StageRecord, b: StageRecord) -> tuple[str, Loc] | None:
    for key in sorted({*a.native, *b.native} - set(_IGNORED)):
        if a.native.get(key) != b.native.get(key):
            return repr(key), b.moves.get((key,), b.loc)
    a_ids, b_ids = {stage_number(a.stage_id)}, {stage_number(b.stage_id)}
    for kind in ("input_connectors", "output_connectors"):
        ea, eb = _edges(a, kind, a_ids | b_ids), _edges(b, kind, a_ids | b_ids)
        if ea != eb:
            return f"its {kind} ({_show(eb)} against {_show(ea)})", b.moves.get((kind,), b.loc)
    return None


def _edges(record: StageRecord, kind: str, group_ids: set[int | None]) -> dict[int, Any]:
    edges = record.native.get(kind)
    out: dict[int, Any] = {}
    for key, ref in (edges or {}).items() if isinstance(edges, dict) else ():
        match = _EDGE_KEY.match(str(key))
        if match is not None and int(match.group(2)) not in group_ids:
            out[int(match.group(2))] = ref
    return out


def _show(edges: dict[int, Any]) -> str:
    return ", ".join(f"{n}: {ref!r}" for n, ref in sorted(edges.items())) or "none"


def _fold(records: list[StageRecord], group: list[StageRecord]) -> list[StageRecord]:
    """``group`` becomes its first stage with the replicas of all; edges to the others now go to it."""
    head, rest = group[0], group[1:]
    head_id = stage_number(head.stage_id)
    gone = {stage_number(r.stage_id) for r in rest}
    total = 0
    for r in group:
        count = r.native.get("replicas", 1)
        total += count if isinstance(count, int) and not isinstance(count, bool) else 1
    head.set("replicas", total, head.moves.get(("replicas",), head.loc))
    head.unused["replica_stages"] = ({str(r.stage_id): {k: v for k, (v, _) in r.unused.items()} for r in rest}, head.loc)
    for record in records:
        if record in rest:
            continue
        for kind, prefix in (("input_connectors", "from_stage_"), ("output_connectors", "to_stage_")):
            edges = record.native.get(kind)
            if not isinstance(edges, dict):
                continue
            kept: dict[Any, Any] = {}
            for key, ref in edges.items():
                match = _EDGE_KEY.match(str(key))
                if match is not None and int(match.group(2)) in gone:
                    new = f"{prefix}{head_id}"
                    if new not in edges and new not in kept:
                        kept[new] = ref
                        record.moves[(kind, new)] = record.moves.get((kind, key), record.loc)
                    continue
                kept[key] = ref
            record.native[kind] = kept
    return [r for r in records if r not in rest]
