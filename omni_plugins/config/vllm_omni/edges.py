"""The edges of a vLLM-Omni file, registered as vLLM-Omni's ``load_omni_transfer_config`` registers them.

In file order, each stage's ``input_connectors`` then ``output_connectors``: the first end written
decides an edge's connector; the other end must name a connector of the same ``name`` (a
different one is an error, as in vLLM-Omni; another definition of the same connector is overridden
by the first, with a note when the two differ). A reference is a name under the connectors section
or an inline ``{name, extra}``. Then every edge of ``runtime.edges`` (``edges`` in the deploy layout)
and every ``engine_input_source`` entry (several: a fan-in stage) that no end names gets vLLM-Omni's
automatic connector, a ``SharedMemoryConnector`` with no settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from omni_plugins.config.vllm_omni.reading import Reading, StageRecord
from omni_plugins.config.yamldoc import Loc

_KEY = {"input_connectors": re.compile(r"^from_stage_(\d+)$"), "output_connectors": re.compile(r"^to_stage_(\d+)$")}
#: the connector vLLM-Omni gives an edge that names none
AUTO_CONNECTOR = "SharedMemoryConnector"
AUTO_INSTANCE = "auto-shared-memory"


@dataclass
class EdgeEnd:
    """The end of an edge that decides its connector."""

    instance: str
    #: the connector's ``name`` as written (ends are compared by it, as vLLM-Omni compares them)
    connector: str
    loc: Loc
    label: str


def stage_number(value: Any) -> int | None:
    """A stage id as an int (vLLM-Omni compares them as text: ``0`` and ``"0"`` are one stage); None if it is none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


class EdgeReader:
    """Registers edges and writes them onto the stage records."""

    def __init__(self, reading: Reading, defined: dict[str, tuple[Any, Loc]], section: str) -> None:
        self.reading = reading
        #: connector instances defined in the file's connectors section: name -> (definition, location)
        self.defined = defined
        self.section = section
        self.table: dict[tuple[int, int], EdgeEnd] = {}
        #: instances made for inline definitions and the automatic connector: name -> (definition, location)
        self.made: dict[str, tuple[Any, Loc]] = {}
        #: instances some edge uses
        self.used: set[str] = set()

    # -- ends written in the file -------------------------------------------------------------
    def declared(self, record: StageRecord, kind: str, value: Any, at: Loc) -> None:
        sid = stage_number(record.stage_id)
        if not isinstance(value, dict) or sid is None:
            record.set(kind, value, at)  # the stage model reports what is wrong
            return
        out: dict[Any, Any] = {}
        for key, ref in value.items():
            ref_at = (*at, key)
            match = _KEY[kind].match(str(key))
            if match is None:
                out[key] = ref  # the stage model names the malformed key
                record.moves[(kind, key)] = ref_at
                continue
            other = int(match.group(1))
            edge = (other, sid) if kind == "input_connectors" else (sid, other)
            side = f"{record.label()}: {kind}.{key}"
            end = self._end(ref, ref_at, side, f"stage{sid}.{key}")
            if end is None:
                continue
            first = self.table.setdefault(edge, end)
            if first.connector != end.connector:
                self.reading.problem(
                    ref_at, f"uses {end.connector!r} but {first.label} uses {first.connector!r}; both ends of an edge must agree"
                )
                continue
            if first.instance != end.instance and self._definition(first.instance) != self._definition(end.instance):
                self.reading.notes.append(
                    f"{self.reading.where(ref_at)}: edge {edge[0]} -> {edge[1]} uses {first.instance!r} ({first.label}, written "
                    f"first); this end's {end.instance!r} is not used, as in vLLM-Omni"
                )
            self.used.add(first.instance)
            out[key] = {**ref, "connector": first.instance} if isinstance(ref, dict) and "connector" in ref else first.instance
            record.moves[(kind, key)] = ref_at
        record.native[kind] = out
        record.moves[(kind,)] = at

    def _end(self, ref: Any, at: Loc, label: str, inline_name: str) -> EdgeEnd | None:
        if isinstance(ref, str):
            if ref not in self.defined:
                self.reading.problem(at, f"connector {ref!r} is not defined under {self.section} (defined: {sorted(self.defined)})")
                return None
            return EdgeEnd(ref, self._name(self.defined[ref][0]), at, label)
        if isinstance(ref, dict) and "name" in ref:  # an inline definition, as vLLM-Omni allows
            if not isinstance(ref["name"], str) or not ref["name"].strip():
                self.reading.problem((*at, "name"), f"an inline connector's name must be a connector name, got {ref['name']!r}")
                return None
            instance = self._unique(inline_name)
            self.made[instance] = (ref, at)
            return EdgeEnd(instance, ref["name"], at, label)
        if isinstance(ref, dict) and isinstance(ref.get("connector"), str):  # omni-plugins' edge mapping
            return self._end(ref["connector"], (*at, "connector"), label, inline_name)
        self.reading.problem(at, f"an edge names a connector under {self.section}, or defines one inline as {{name, extra}}; got {ref!r}")
        return None

    # -- edges vLLM-Omni wires itself ---------------------------------------------------------
    def automatic(self, frm: Any, to: Any, at: Loc, records: dict[int, StageRecord]) -> None:
        """An edge from ``runtime.edges`` / ``edges`` / ``engine_input_source``: the automatic connector unless an end names one."""
        a, b = stage_number(frm), stage_number(to)
        if a is None or b is None:
            self.reading.problem(at, f"an edge goes between stage ids (integers), got {frm!r} -> {to!r}")
            return
        if (a, b) in self.table:
            return
        receiver, sender = records.get(b), records.get(a)
        if receiver is None and sender is None:
            self.reading.problem(at, f"edge {a} -> {b}: neither stage exists (stages: {sorted(records)})")
            return
        instance = self._auto(at)
        self.table[(a, b)] = EdgeEnd(instance, AUTO_CONNECTOR, at, f"the automatic edge {a} -> {b}")
        self.used.add(instance)
        record, kind, key = (receiver, "input_connectors", f"from_stage_{a}") if receiver is not None else (sender, "output_connectors", f"to_stage_{b}")
        assert record is not None
        edges = record.native.setdefault(kind, {})
        if isinstance(edges, dict):
            edges[key] = instance
            record.moves[(kind, key)] = at

    def _auto(self, at: Loc) -> str:
        for name, (definition, _) in self.made.items():
            if name.startswith(AUTO_INSTANCE) and definition == {"name": AUTO_CONNECTOR}:
                return name
        instance = self._unique(AUTO_INSTANCE)
        self.made[instance] = ({"name": AUTO_CONNECTOR}, at)
        return instance

    # -- helpers ----------------------------------------------------------------------------
    def _unique(self, name: str) -> str:
        n, candidate = 1, name
        while candidate in self.defined or candidate in self.made:
            n += 1
            candidate = f"{name}-{n}"
        return candidate

    def _definition(self, instance: str) -> Any:
        found = self.defined.get(instance) or self.made.get(instance)
        return found[0] if found else None

    @staticmethod
    def _name(definition: Any) -> str:
        name = definition.get("name") if isinstance(definition, dict) else None
        return name if isinstance(name, str) else repr(name)
