"""The payload builder of synthetic stages (named in the stage config by ``omni-plugins run``).

The synthetic model's per-step output is flat: ``{"section.field": tensor,
"trace.step": [[step]]}``. The builder nests it into payload sections (the
routed one keeps what the destination gets, see ``outputs[].to``), sets
``meta.finished`` and stamps the wall-clock send time per step row
(``trace.sent_at``), so the consumer can measure hand-off latency.
"""

from __future__ import annotations

import time
from typing import Any

import torch

BUILDER_PATH = "omni_plugins.pipeline.builders.synthetic_payload"
#: for a stage whose destinations get different outputs (``outputs[].to``): told the destination, called per edge
ROUTED_BUILDER_PATH = "omni_plugins.pipeline.builders.routed_payload"


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, field = key.partition(".")
        out.setdefault(section, {})[field] = value
    return out


def synthetic_payload(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> dict[str, Any] | None:
    """One payload for every destination."""
    if not isinstance(pooling_output, dict) or not pooling_output:
        return None
    return _payload(pooling_output, is_finished)


def routed_payload(transfer_manager: Any, pooling_output: Any, request: Any, to_stage: int, is_finished: bool = False) -> dict[str, Any] | None:
    """What ``to_stage`` gets: the outputs the request's ``routes[to_stage]`` names (and the trace)."""
    if not isinstance(pooling_output, dict) or not pooling_output:
        return None
    names = getattr(request, "routes", {}).get(to_stage)
    if names is not None:
        pooling_output = {k: v for k, v in pooling_output.items() if k in names or k.startswith("trace.")}
    return _payload(pooling_output, is_finished)


def _payload(pooling_output: dict[str, Any], is_finished: bool) -> dict[str, Any]:
    payload = nest(pooling_output)
    trace = payload.setdefault("trace", {})
    steps = trace.get("step")
    rows = int(steps.shape[0]) if isinstance(steps, torch.Tensor) else 1
    trace["sent_at"] = torch.full((rows, 1), time.time(), dtype=torch.float64)
    payload.setdefault("meta", {})["finished"] = bool(is_finished)
    return payload
