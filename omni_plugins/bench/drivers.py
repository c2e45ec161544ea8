"""What one benchmarked backend is: the connector's config, and the raw baseline its plugin offers.

A driver runs in two processes. The producer (parent) puts a payload under a key; the
consumer (child) gets it and owns a copy. ``raw`` is the plugin's raw baseline
(:class:`omni_plugins.services.RawBaseline`: the same bytes through the backend without the
connector); ``omni`` is the connector (``put`` / blocking ``get``, wire-encoded tensors).
Each process builds its ends from a picklable :class:`DriverSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_plugins.services import RawBaseline

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DriverSpec:
    """Which connector, its config (a stage's ``extra`` mapping) and the largest payload."""

    backend: str
    config: dict[str, Any]
    max_bytes: int


def make_raw(spec: DriverSpec, producer: bool) -> RawBaseline:
    """This process's end of the backend's raw baseline, reaching the backend the connector's config reaches."""
    from omni_plugins.factory import validate_connector_config
    from omni_plugins.services import require

    services = require(spec.backend, "raw_baseline")
    return services.raw_baseline(validate_connector_config(spec.backend, spec.config), spec.max_bytes, producer)
