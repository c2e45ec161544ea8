"""The payload builder of synthetic stages (named in the stage config by ``omni-plugins run``).

The synthetic model's per-step output is flat: ``{"section.field": tensor,
"trace.step": [[step]]}``. The builder nests it into payload sections, sets
``meta.finished`` and stamps the wall-clock send time per step row
(``trace.sent_at``), so the consumer can measure hand-off latency.
"""

from __future__ import annotations

import time
from typing import Any

import torch

BUILDER_PATH = "omni_plugins.pipeline.builders.synthetic_payload"


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": v}`` -> ``{"a": {"b": v}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        section, _, field = key.partition(".")
        out.setdefault(section, {})[field] = value
    return out


def synthetic_payload(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> dict[str, Any] | None:
    if not isinstance(pooling_output, dict) or not pooling_output:
        return None
    payload = nest(pooling_output)
    trace = payload.setdefault("trace", {})
    steps = trace.get("step")
    rows = int(steps.shape[0]) if isinstance(steps, torch.Tensor) else 1
    trace["sent_at"] = torch.full((rows, 1), time.time(), dtype=torch.float64)
    payload.setdefault("meta", {})["finished"] = bool(is_finished)
    return payload
