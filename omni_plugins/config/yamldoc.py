"""One parsed YAML file: its data and the line every value was written on.

Safe loading only (no tags that build objects), ``${VAR}`` interpolation of string values, merge
keys (``<<: *anchor``) built without PyYAML's exponential copying, and a bound on the values an
alias-heavy document may expand to.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from omni_plugins.config.interpolate import MalformedReferenceError, MissingVariableError, interpolate
from omni_plugins.errors import ConfigError

Loc = tuple[str | int, ...]

#: values one document may expand to; a pipeline file has hundreds, an alias bomb billions
MAX_NODES = 20_000

#: libyaml's composer when PyYAML was built with it (5x faster than the pure-Python one, and
#: what a fuzzer's throughput depends on); both give nodes with the same start marks
_COMPOSER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: the tag PyYAML's resolver gives a plain ``<<`` key
_MERGE_TAG = "tag:yaml.org,2002:merge"

#: sequences whose items are stages: a stage's label in a location names its ``stage_id``
STAGE_LISTS = ("stages", "stage_args")


class YamlDoc:
    """A parsed YAML document plus the line of every node, by path."""

    def __init__(self, text: str, filename: str, env: Mapping[str, str] | None) -> None:
        self.filename = filename
        self.lines: dict[Loc, int] = {}
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

    @classmethod
    def read(cls, path: str | Path, env: Mapping[str, str] | None) -> YamlDoc:
        """Read and parse a file; errors name it (unreadable, not UTF-8 with the line, not YAML)."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise ConfigError(f"{p}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save the file as UTF-8") from None
        return cls(text, str(p), env)

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
                raise ConfigError(f"{self.filename}:{m.start_mark.line + 1}: {format_loc(loc, None)}: '<<' (merge key) takes a mapping or a list of mappings")
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
        """The line ``loc`` (or the nearest enclosing value that exists) was written on."""
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())

    def where(self, loc: Loc) -> str:
        """``file:line: path`` of a location in this file."""
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
                and loc[i - 1] in STAGE_LISTS
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
