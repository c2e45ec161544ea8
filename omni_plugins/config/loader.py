"""Load a pipeline YAML file into a validated :class:`PipelineConfig`.

Errors name the file, the line, the stage and the field, e.g.::

    pipeline.yaml:14: stages[1] (stage 1): rank_mapping: the larger TP size must be divisible ...
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from omni_plugins.config.interpolate import MalformedReferenceError, MissingVariableError, interpolate
from omni_plugins.config.models import GraphError, PipelineConfig
from omni_plugins.errors import ConfigError, OmniPluginsError

Loc = tuple[str | int, ...]

#: values one document may expand to; a pipeline file has hundreds, an alias bomb billions
MAX_NODES = 20_000

#: libyaml's composer when PyYAML was built with it (5x faster than the pure-Python one, and
#: what a fuzzer's throughput depends on); both give nodes with the same start marks
_COMPOSER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: keys of a peer (vllm-omni) stage's ``engine_args`` that map onto our StageConfig
_PEER_ENGINE_KEYS = (
    "model_stage",
    "worker_type",
    "async_chunk",
    "custom_process_input_func",
    "custom_process_next_stage_input_func",
    "final_output",
)

#: keys of a vllm-omni stage that configure its engine, placement or sampling, not the transfer:
#: ignored (with one warning) in a file in the peer layout
_PEER_STAGE_ONLY = ("runtime", "stage_type", "is_comprehension", "final_output_type", "default_sampling_params", "engine_input_source")
#: keys of vllm-omni's top-level ``runtime`` besides ``connectors``, ignored likewise
_PEER_RUNTIME_ONLY = ("enabled", "defaults", "edges")

logger = logging.getLogger(__name__)


#: the tag PyYAML's resolver gives a plain ``<<`` key
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Doc:
    """A parsed YAML document plus the line of every node, by path."""

    def __init__(self, text: str, filename: str, env: Mapping[str, str] | None) -> None:
        self.filename = filename
        self.lines: dict[Loc, int] = {}
        #: where a validated location was written, by prefix: a peer-layout file's stages are its ``stage_args``
        self.renames: dict[Loc, Loc] = {}
        self.data: Any = None
        self._nodes = 0
        self._open: set[int] = set()  # ids of the nodes being built (a recursive alias comes back to one)
        self._constructor = yaml.constructor.SafeConstructor()  # one per document: scalars are built with it
        try:
            node = yaml.compose(text, Loader=_COMPOSER)
            if node is not None:
                self.data = self._build(node, (), env)
        except ConfigError:
            raise
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{filename}{line}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
        except RecursionError:
            raise ConfigError(f"{filename}: not valid YAML: nested too deeply") from None
        except (TypeError, ValueError) as exc:  # unhashable keys ({[1]: 2}, ? !!set), integers too long to convert
            raise ConfigError(f"{filename}: not valid YAML: {exc}") from None

    def _build(self, node: yaml.Node, loc: Loc, env: Mapping[str, str] | None) -> Any:
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise ConfigError(f"{self.filename}: the document expands to more than {MAX_NODES} values (YAML aliases?)")
        if id(node) in self._open:
            raise ConfigError(f"{self.where(loc)}: recursive YAML alias")
        self.lines[loc] = node.start_mark.line + 1
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
            self._open.add(id(node))
            try:
                return self._build_collection(node, loc, env)
            finally:
                self._open.discard(id(node))
        return self._scalar(node, loc, env)

    def _build_collection(self, node: yaml.Node, loc: Loc, env: Mapping[str, str] | None) -> Any:
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            merges: list[yaml.Node] = []
            for k_node, v_node in node.value:
                if k_node.tag == _MERGE_TAG:
                    merges.append(v_node)
                    continue
                key = (
                    self._constructor.construct_object(k_node, deep=True)
                    if not isinstance(k_node, yaml.ScalarNode)
                    else self._scalar(k_node, loc, env)
                )
                if key in out:
                    raise ConfigError(f"{self.where((*loc, key))}: duplicate key {key!r}")
                out[key] = self._build(v_node, (*loc, key), env)
            return {**self._merged(merges, loc, env, out), **out} if merges else out
        return [self._build(v, (*loc, i), env) for i, v in enumerate(node.value)]

    def _merged(self, merges: list[yaml.Node], loc: Loc, env: Mapping[str, str] | None, own: dict[Any, Any]) -> dict[Any, Any]:
        """The keys a mapping's ``<<: *a`` / ``<<: [*a, *b]`` bring in (its own keys win, then earlier mappings).

        Built here rather than by PyYAML's ``flatten_mapping``, which copies node lists: merges of merges
        would grow exponentially before the node limit sees them. A merged key's line is where it is
        written (the anchored mapping).
        """
        sources: list[yaml.Node] = []
        for m in merges:
            items = m.value if isinstance(m, yaml.SequenceNode) else [m]
            if not all(isinstance(i, yaml.MappingNode) for i in items):
                raise ConfigError(
                    f"{self.filename}:{m.start_mark.line + 1}: {format_loc(loc, None)}: '<<' (merge key) takes a mapping or a list of mappings"
                )
            sources += items
        outer, self.lines = self.lines, {}
        merged: dict[Any, Any] = {}
        try:
            for src in reversed(sources):
                merged.update(self._build(src, loc, env))
        finally:
            built, self.lines = self.lines, outer
        n = len(loc)
        self.lines.update((path, line) for path, line in built.items() if len(path) > n and path[n] not in own)
        return {k: v for k, v in merged.items() if k not in own}

    def _scalar(self, node: yaml.Node, loc: Loc, env: Mapping[str, str] | None) -> Any:
        value = self._constructor.construct_object(node)
        if isinstance(value, str) and "$" in value:
            try:
                # the result stays a string: YAML typing applies to what the file says, not to a
                # variable's value (REDIS_PASSWORD=123456 or =null must not turn into an int or
                # None, OMNI_SHM_NAMESPACE=2024 not into an int); fields that take numbers convert
                # numeric strings (port: ${PORT:-6379}). Nor does substituted text ever become YAML
                # structure: no lists, maps or aliases smuggled in through a variable.
                value = interpolate(value, env)
            except MissingVariableError as exc:
                raise ConfigError(
                    f"{self.where(loc)}: environment variable ${{{exc.variable}}} is not set (use ${{{exc.variable}:-default}} for a default)"
                ) from None
            except MalformedReferenceError as exc:
                raise ConfigError(f"{self.where(loc)}: {exc}") from None
        return value

    def line_of(self, loc: Loc) -> int | None:
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())

    def origin(self, loc: Loc) -> Loc:
        """The location in the file of ``loc`` (a location in the data as validated)."""
        for n in range(len(loc), 0, -1):
            if loc[:n] in self.renames:
                return (*self.renames[loc[:n]], *loc[n:])
        return loc

    def where(self, loc: Loc) -> str:
        """``file:line: path`` of ``loc``, both as written in the file."""
        loc = self.origin(loc)
        line = self.line_of(loc)
        return f"{self.filename}{f':{line}' if line else ''}: {format_loc(loc, self.data)}"


def format_loc(loc: Loc, data: Any) -> str:
    """``stages[1] (stage 2).rank_mapping.from_tp`` from a pydantic/YAML location."""
    parts: list[str] = []
    node = data
    for i, p in enumerate(loc):
        if isinstance(p, int):
            label = f"[{p}]"
            if (
                i > 0
                and loc[i - 1] in ("stages", "stage_args")
                and isinstance(node, list)
                and p < len(node)
                and isinstance(node[p], dict)
                and "stage_id" in node[p]
            ):
                label += f" (stage {node[p]['stage_id']})"
            parts.append(label)
        else:
            parts.append(("." if parts else "") + str(p))
        node = node[p] if isinstance(node, (dict, list)) and _has(node, p) else None  # type: ignore[index]
    return "".join(parts) or "(top level)"


def _has(node: dict[Any, Any] | list[Any], p: str | int) -> bool:
    return (p in node) if isinstance(node, dict) else (isinstance(p, int) and 0 <= p < len(node))


def _from_peer_layout(data: dict[str, Any], filename: str, renames: dict[Loc, Loc]) -> dict[str, Any]:
    """Accept vllm-omni style files: ``stage_args`` for ``stages``, ``runtime.connectors``, ``engine_args`` keys.

    In such a file (``stage_args`` or a top-level ``runtime``) the peer's keys that do not concern
    the transfer (:data:`_PEER_STAGE_ONLY`, :data:`_PEER_RUNTIME_ONLY`) are dropped with one
    warning listing them; any other unknown key stays an error. ``renames`` gets where each moved location was written.
    """
    data = dict(data)
    peer = "stage_args" in data or isinstance(data.get("runtime"), dict)
    ignored: dict[str, list[Any]] = {}
    if "stage_args" in data and "stages" not in data:
        data["stages"] = data.pop("stage_args")
        renames[("stages",)] = ("stage_args",)
    runtime = data.get("runtime")
    if isinstance(runtime, dict):
        runtime = dict(runtime)
        if "connectors" in runtime and "connectors" not in data:
            data["connectors"] = runtime.pop("connectors")
            renames[("connectors",)] = ("runtime", "connectors")
        for k in _PEER_RUNTIME_ONLY:
            if k in runtime:
                del runtime[k]
                ignored[f"runtime.{k}"] = []
        if runtime:
            data["runtime"] = runtime
        else:
            data.pop("runtime")
    stages = data.get("stages")
    if isinstance(stages, list):
        lifted = []
        for i, st in enumerate(stages):
            if isinstance(st, dict) and isinstance(st.get("engine_args"), dict):
                st = dict(st)
                engine = st.pop("engine_args")
                for k in _PEER_ENGINE_KEYS:
                    if k in engine and k not in st:
                        st[k] = engine[k]
                        renames[("stages", i, k)] = (*renames.get(("stages",), ("stages",)), i, "engine_args", k)
            if peer and isinstance(st, dict) and any(k in st for k in _PEER_STAGE_ONLY):
                st = dict(st)
                for k in _PEER_STAGE_ONLY:
                    if k in st:
                        del st[k]
                        ignored.setdefault(k, []).append(st.get("stage_id", f"[{i}]"))
            lifted.append(st)
        data["stages"] = lifted
    if ignored:
        logger.warning(
            "%s: ignored vllm-omni settings that omni-plugins does not use: %s",
            filename,
            ", ".join(f"{k} (stage {', '.join(map(str, where))})" if where else k for k, where in ignored.items()),
        )
    return data


def load_pipeline_config(
    path: str | Path, *, env: Mapping[str, str] | None = None, check_plugins: bool = True, check_builders: bool = True
) -> PipelineConfig:
    """Read, interpolate and validate a pipeline YAML file.

    Phase 1 checks structure; phase 2 (``check_plugins``) validates each
    connector instance's ``extra`` with its plugin's model and that the name is
    known; phase 3 (``check_builders``) imports payload builders and checks
    their signatures. Every error is a :class:`ConfigError` naming file, line,
    stage and field.
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{p}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save the file as UTF-8"
        ) from None
    return parse_pipeline_config(text, filename=str(p), env=env, check_plugins=check_plugins, check_builders=check_builders)


def parse_pipeline_config(
    text: str, *, filename: str = "<string>", env: Mapping[str, str] | None = None, check_plugins: bool = True, check_builders: bool = True
) -> PipelineConfig:
    doc = _Doc(text, filename, env)
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{filename}: the top level must be a mapping with 'connectors' and 'stages'")
    # x-* top-level keys are extension fields, ignored: a place for anchors used with merge keys (<<: *common)
    data = _from_peer_layout({k: v for k, v in doc.data.items() if not (isinstance(k, str) and k.startswith("x-"))}, filename, doc.renames)
    try:
        config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, doc, data)) from None
    errors: list[str] = []
    if check_plugins:
        errors += _check_plugins(config, doc)
    if check_builders:
        errors += _check_builders(config, doc)
    if errors:
        raise ConfigError("\n".join(errors))
    return config


def _format_errors(exc: ValidationError, doc: _Doc, data: Any) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        graph = err.get("ctx", {}).get("error")
        if isinstance(graph, GraphError):  # a model-level check: each problem carries its own location
            for problem in graph.problems:
                lines.append(f"{doc.where((*loc, *problem.loc))}: {problem.message}")
            continue
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden" and loc == ("runtime",) and isinstance(err.get("input"), dict):
            for key in err["input"]:  # what is left of vllm-omni's runtime after connectors and the ignored keys
                used = f"used: connectors; ignored: {', '.join(_PEER_RUNTIME_ONLY)}"
                lines.append(f"{doc.where((*loc, key))}: unknown field {key!r} ({used})")
            continue
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field {loc[-1]!r}" + _field_hint(loc, data)
            if len(loc) == 1:
                msg += "; top-level keys starting with 'x-' are ignored (a place for YAML anchors)"
        elif err.get("type") == "missing":
            msg = f"required field {loc[-1]!r} is missing"
        lines.append(f"{doc.where(loc)}: {msg}")
    return "\n".join(lines)


def _field_hint(loc: Loc, data: Any) -> str:
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
    return _close_match(str(loc[-1]), fields) or f" (allowed: {', '.join(fields)})"


def _close_match(name: str, candidates: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or ''."""
    import difflib

    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _plugin_field_names(model: Any, path: Loc) -> list[str]:
    """Field names (and alias choices) of ``model`` at ``path``, descending into nested models."""
    for p in path:
        field = getattr(model, "model_fields", {}).get(p) if isinstance(p, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        model = field.annotation
    names: list[str] = []
    for name, field in getattr(model, "model_fields", {}).items():
        choices = getattr(field.validation_alias, "choices", None) or [field.validation_alias or field.alias]
        names += [name, *(c for c in choices if isinstance(c, str) and c != name)]
    return names


def _check_plugins(config: PipelineConfig, doc: _Doc) -> list[str]:
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
                    hint = _close_match(key, _plugin_field_names(exc.model, eloc[3:-1]))
                    msg = f"unknown field {key!r}" + (hint or f" ('omni-plugins schema {conn.name}' lists the fields)")
                elif err.get("type") == "missing":
                    msg = f"required field {eloc[-1]!r} is missing"
                errors.append(f"{doc.where(eloc)}: {msg}{about}")
        except OmniPluginsError as exc:
            line = doc.line_of(doc.origin((*loc, "extra" if "extra" in str(exc) else "name")))
            errors.append(f"{doc.filename}{f':{line}' if line else ''}: {format_loc(doc.origin(loc), doc.data)}{used}: {exc}")
    return errors


def _check_builders(config: PipelineConfig, doc: _Doc) -> list[str]:
    from omni_plugins.payload import load_builder

    errors = []
    for i, s in enumerate(config.stages):
        paths: list[tuple[Loc, str | None]] = [
            (("stages", i, "custom_process_next_stage_input_func"), s.custom_process_next_stage_input_func)
        ]
        paths += [(("stages", i, "output_connectors", key, "payload_builder"), e.payload_builder) for key, e in s.output_connectors.items()]
        for loc, path in paths:
            if not path:
                continue
            try:
                load_builder(path)
            except OmniPluginsError as exc:
                errors.append(f"{doc.where(loc)}: {exc}")
    return errors
