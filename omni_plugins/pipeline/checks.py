"""What ``omni-plugins run`` checks before it starts a process, shared with ``omni-plugins validate``.

A file with ``synthetic:`` blocks is a ``run`` file: ``validate`` must reject
everything ``run`` would reject, so both call :func:`plan_for_run`.
"""

from __future__ import annotations

from omni_plugins.config.models import PipelineConfig
from omni_plugins.config.placement import placement_errors
from omni_plugins.errors import ConfigError, OmniPluginsError
from omni_plugins.pipeline.spec import PipelinePlan, build_plan


def cross_process_errors(config: PipelineConfig, filename: str) -> list[str]:
    """Every stage is its own process: an in-process-only connector on an edge could never deliver."""
    from omni_plugins.factory import resolve_connector

    used = {name for e in config.edge_list() for name in ((e.connector, e.kv_connector) if e.kv else (e.connector,))}
    errors = []
    for instance in sorted(used):
        conn = config.connectors[instance]
        try:
            cross = resolve_connector(conn.name).load_class().capabilities.cross_process
        except OmniPluginsError:
            continue  # an unknown or broken connector is the loader's error, reported there
        if not cross:
            errors.append(
                f"{filename}: connectors.{instance}: connector {conn.name!r} is in-process only; "
                f"'omni-plugins run' runs every stage in its own process (use shm, redis, mooncake-store, mooncake-te ...)"
            )
    return errors


def plan_for_run(config: PipelineConfig, *, filename: str) -> PipelinePlan:
    """The graph ``run`` drives, after every check; one :class:`ConfigError` lists all that failed."""
    errors: list[str] = []
    plan: PipelinePlan | None = None
    try:
        plan = build_plan(config, filename=filename)
    except ConfigError as exc:
        errors.append(str(exc))
    errors += cross_process_errors(config, filename)
    errors += placement_errors(config, filename)
    if errors or plan is None:
        raise ConfigError("\n".join(errors))
    return plan
