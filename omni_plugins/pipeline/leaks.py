"""After a run: does any backend still hold something, and freeing what a run left.

Stage processes report their own connector's ``health()`` (:func:`health_leaks` reads the
held-payload fields). What outlives the processes -- segments, keys, store objects, files --
is counted and freed by each connector's plugin through its ``census`` and ``reclaim``
services (:mod:`omni_plugins.services`), once per connector instance of the pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from omni_plugins.config.models import PipelineConfig
from omni_plugins.services import Finding, RunScope, ServiceUnavailable

logger = logging.getLogger(__name__)

#: ``health()`` fields that count payloads a connector still holds
HELD_FIELDS = ("staged", "being_read")


def run_id_prefix(run_tag: str) -> str:
    """How every request id of the run ``run_tag`` starts, and so every backend key of its payloads: ``req-<run_tag>-``."""
    return RunScope(run_tag).request_prefix


def backend_leaks(config: PipelineConfig, instances: Iterable[str], run_tag: str) -> list[str]:
    """What the backends of the connector instances ``instances`` still hold of the run ``run_tag``.

    One line per instance with leftovers (its plugin's ``census``); call after every stage process exited.
    """
    return _per_instance(config, instances, run_tag, "census", "leak check", Finding.census_line)


def reclaim(config: PipelineConfig, instances: Iterable[str], run_tag: str) -> list[str]:
    """After a run that left something (a stage killed, a run interrupted): free it, so nothing stays behind.

    One line per connector instance that had something removed (its plugin's ``reclaim``). Call
    after every stage process exited.
    """
    return _per_instance(config, instances, run_tag, "reclaim", "reclaim", Finding.reclaim_line)


def _per_instance(
    config: PipelineConfig, instances: Iterable[str], run_tag: str, service: str, what: str, line: Callable[[Finding], str]
) -> list[str]:
    """Run ``service`` for each connector instance whose plugin offers it; a failing one is one line, the others still run."""
    from omni_plugins.factory import resolve_connector, validate_connector_config
    from omni_plugins.services import offered

    out: list[str] = []
    for instance in sorted(set(instances)):
        conn = config.connectors[instance]
        try:
            services = resolve_connector(conn.name).load_services()
            if services is None or service not in offered(services):
                continue
            finding: Finding = getattr(services, service)(validate_connector_config(conn.name, conn.extra), RunScope(run_tag))
        except ServiceUnavailable as exc:
            out.append(f"connector {instance!r}: {what} failed: {exc}")
            continue
        except Exception as exc:
            logger.debug("%s of connector %r failed", what, instance, exc_info=True)
            out.append(f"connector {instance!r}: {what} failed: {type(exc).__name__}: {exc}")
            continue
        if finding.count:
            out.append(f"connector {instance!r}: {line(finding)}")
    return out


def health_leaks(where: str, health: dict[str, Any]) -> list[str]:
    """Payloads a stage process's connector still held before closing, from its ``health()``."""
    out = []
    for key in HELD_FIELDS:
        value = health.get(key)
        if isinstance(value, int) and value > 0:
            out.append(f"{where}: connector still holds {value} {key} payload(s)")
    return out
