"""Load a pipeline YAML file into a validated :class:`PipelineConfig`.

Errors name the file, the line, the stage and the field, e.g.::

    pipeline.yaml:14: stages[1] (stage 1): rank_mapping: the larger TP size must be divisible ...
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from omni_plugins.config.hints import close_match, model_field_names
from omni_plugins.config.models import GraphError, PipelineConfig
from omni_plugins.config.origins import Origins
from omni_plugins.config.overlays import resolve_overlays
from omni_plugins.config.vllm_omni import is_vllm_omni, read_vllm_omni
from omni_plugins.config.yamldoc import Loc, YamlDoc
from omni_plugins.errors import ConfigError, OmniPluginsError


def load_pipeline_config(
    path: str | Path,
    *,
    env: Mapping[str, str] | None = None,
    check_plugins: bool = True,
    check_builders: bool = True,
    platform: str | None = None,
) -> PipelineConfig:
    """Read, interpolate and validate a pipeline YAML file.

    Phase 1 checks structure; phase 2 (``check_plugins``) validates each
    connector instance's ``extra`` with its plugin's model and that the name is
    known; phase 3 (``check_builders``) imports payload builders and checks
    their signatures. Every error is a :class:`ConfigError` naming file, line,
    stage and field. A vLLM-Omni file (either of its layouts) is read into the
    same fields; ``platform`` selects its ``platforms`` section (npu, rocm, xpu ...).
    """
    doc = YamlDoc.read(path, env)
    return _validate(doc, env=env, check_plugins=check_plugins, check_builders=check_builders, platform=platform)


def parse_pipeline_config(
    text: str,
    *,
    filename: str = "<string>",
    env: Mapping[str, str] | None = None,
    check_plugins: bool = True,
    check_builders: bool = True,
    platform: str | None = None,
) -> PipelineConfig:
    """:func:`load_pipeline_config` of YAML text (``base_config`` paths resolve relative to ``filename``)."""
    return _validate(YamlDoc(text, filename, env), env=env, check_plugins=check_plugins, check_builders=check_builders, platform=platform)


def _validate(doc: YamlDoc, *, env: Mapping[str, str] | None, check_plugins: bool, check_builders: bool, platform: str | None) -> PipelineConfig:
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{doc.filename}: the top level must be a mapping with 'connectors' and 'stages'")
    origins = Origins(doc)
    merged = resolve_overlays(doc, env)
    data: dict[Any, Any] = doc.data
    if merged is not None:
        data, origins.files = merged
    # x-* top-level keys are extension fields, ignored: a place for anchors used with merge keys (<<: *common)
    data = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("x-"))}
    if merged is not None or is_vllm_omni(data):
        data = read_vllm_omni(data, origins, platform=platform)
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, origins, data)) from None
    errors: list[str] = []
    if check_plugins:
        errors += _check_plugins(config, origins)
    if check_builders:
        errors += _check_builders(config, origins)
    if errors:
        raise ConfigError("\n".join(errors))
    return config


def _format_errors(exc: ValidationError, origins: Origins, data: Any) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        graph = err.get("ctx", {}).get("error")
        if isinstance(graph, GraphError):  # a model-level check: each problem carries its own location
            for problem in graph.problems:
                lines.append(f"{origins.where((*loc, *problem.loc))}: {problem.message}")
            continue
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field {loc[-1]!r}" + _field_hint(loc)
            if len(loc) == 1:
                msg += "; top-level keys starting with 'x-' are ignored (a place for YAML anchors)"
        elif err.get("type") == "missing":
            msg = f"required field {loc[-1]!r} is missing"
        lines.append(f"{origins.where(loc)}: {msg}")
    return "\n".join(lines)


def _field_hint(loc: Loc) -> str:
    from omni_plugins.config.models import ConnectorConfig, EdgeConfig, PipelineConfig, RankMapping, StageConfig

    model: Any = PipelineConfig
    for n, p in enumerate(loc[:-1]):
        if model is PipelineConfig and p == "stages":
            model = StageConfig
        elif model is PipelineConfig and p == "connectors":
            model = ConnectorConfig
        elif p == "rank_mapping":
            model = RankMapping
        elif model is StageConfig and p in ("input_connectors", "output_connectors") and n + 2 < len(loc):
            model = EdgeConfig
    fields = list(getattr(model, "model_fields", {}))
    return close_match(str(loc[-1]), fields) or f" (allowed: {', '.join(fields)})"


def _check_plugins(config: PipelineConfig, origins: Origins) -> list[str]:
    from omni_plugins.factory import ConnectorConfigError, validate_connector_config

    errors = []
    users: dict[str, list[int]] = {}
    for s in config.stages:
        ends = [*s.input_connectors.values(), *s.output_connectors.values()]
        for instance in {name for e in ends for name in (e.connector, e.kv)}:
            users.setdefault(instance, []).append(s.stage_id)
    for instance, conn in config.connectors.items():
        loc: Loc = ("connectors", instance)
        used = f" (used by stage {', '.join(map(str, sorted(users[instance])))})" if instance in users else ""
        try:
            validate_connector_config(conn.name, conn.extra, where=f"connectors.{instance}.extra")
        except ConnectorConfigError as exc:
            # one line per bad key, at that key's line inside extra
            about = f" [connector {exc.connector!r} from {exc.origin}{'; ' + used.strip(' ()') if used else ''}]"
            for err in exc.errors:
                eloc: Loc = (*loc, "extra", *err.get("loc", ()))
                msg = err.get("msg", "invalid").removeprefix("Value error, ")
                if err.get("type") == "extra_forbidden":
                    key = str(eloc[-1])
                    hint = close_match(key, model_field_names(exc.model, eloc[3:-1]))
                    msg = f"unknown field {key!r}" + (hint or f" ('omni-plugins schema {conn.name}' lists the fields)")
                elif err.get("type") == "missing":
                    msg = f"required field {eloc[-1]!r} is missing"
                errors.append(f"{origins.where(eloc)}: {msg}{about}")
        except OmniPluginsError as exc:
            filename, line = origins.line((*loc, "extra" if "extra" in str(exc) else "name"))
            errors.append(f"{filename}{f':{line}' if line else ''}: {origins.path(loc)}{used}: {exc}")
    return errors


def _check_builders(config: PipelineConfig, origins: Origins) -> list[str]:
    from omni_plugins.payload import load_builder

    errors = []
    for i, s in enumerate(config.stages):
        paths: list[tuple[Loc, str | None]] = [(("stages", i, "custom_process_next_stage_input_func"), s.custom_process_next_stage_input_func)]
        paths += [(("stages", i, "output_connectors", key, "payload_builder"), e.payload_builder) for key, e in s.output_connectors.items()]
        for loc, path in paths:
            if not path:
                continue
            try:
                load_builder(path)
            except OmniPluginsError as exc:
                errors.append(f"{origins.where(loc)}: {exc}")
        if s.cfg_kv_collect_func:
            problem = _callable_problem(s.cfg_kv_collect_func)
            if problem:
                errors.append(f"{origins.where(('stages', i, 'cfg_kv_collect_func'))}: {problem}")
    return errors


def _callable_problem(path: str) -> str | None:
    """What is wrong with the function at dotted ``path`` (None: it imports and is callable)."""
    from omni_plugins.importing import import_string

    try:
        func = import_string(path)
    except ImportError as exc:
        return f"{path!r} cannot be imported: {exc}"
    except Exception as exc:
        return f"{path!r} failed while importing: {type(exc).__name__}: {exc}"
    return None if callable(func) else f"{path!r} is not callable"
