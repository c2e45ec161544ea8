"""Stages on several machines: which edges can cross between them.

A connector whose plugin declares ``capabilities.cross_host = False`` moves
payloads between processes of one machine only (shared memory, a local
directory). An edge over such a connector -- its payloads, or its KV on a KV
edge -- between stages placed on different hosts could never deliver:
:func:`cross_host_errors` names each one, with both hosts, before anything starts
(``omni-plugins validate`` with a ``placement`` section, and the coordinating
host of ``omni-plugins run`` when a host joins).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from omni_plugins.config.models import PipelineConfig
from omni_plugins.errors import OmniPluginsError


def host_local(connector_name: str) -> bool | None:
    """Whether the connector class registered as ``connector_name`` stays on one machine (None: it cannot be loaded)."""
    from omni_plugins.factory import resolve_connector

    try:
        return not resolve_connector(connector_name).load_class().capabilities.cross_host
    except OmniPluginsError:
        return None  # an unknown or broken connector is the loader's error, reported there


def cross_host_errors(config: PipelineConfig, hosts: Mapping[str, Iterable[int]], filename: str) -> list[str]:
    """One line per edge over a host-local connector whose two stages are on different hosts.

    ``hosts`` maps each host name to the stages it runs; stages on no host are not checked.
    """
    where = {sid: host for host, stages in hosts.items() for sid in stages}
    local: dict[str, bool | None] = {}
    errors = []
    for edge in config.edge_list():
        a, b = where.get(edge.from_stage), where.get(edge.to_stage)
        if a is None or b is None or a == b:
            continue
        instances = [("payloads", edge.connector)] + (
            [("KV", edge.kv_connector)] if edge.kv and edge.kv_connector != edge.connector else []
        )
        for what, instance in instances:
            name = config.connectors[instance].name
            if name not in local:
                local[name] = host_local(name)
            if local[name]:
                errors.append(
                    f"{filename}: edge {edge.label} moves its {what} over connector instance {instance!r} ({name}), which is "
                    f"host-local (its plugin declares capabilities.cross_host false), but stage {edge.from_stage} runs on host "
                    f"{a!r} and stage {edge.to_stage} on host {b!r}: place both stages on one host, or move the edge to a "
                    f"connector that crosses hosts"
                )
    return errors


def placement_errors(config: PipelineConfig, filename: str) -> list[str]:
    """:func:`cross_host_errors` for the YAML's ``placement`` (none without one)."""
    if config.placement is None:
        return []
    return cross_host_errors(config, config.placement.hosts, filename)
