"""The one JSON format of every benchmark result (``omni-plugins bench --json``, ``benchmarks/results/*.json``).

A document says where and how it was measured (``machine``, ``command``, ``final``), holds one
table per section (``sections``: the size curve, the load curve, scaling, the peer) and every
target with its measured value and whether it was met (``targets``). A section is generic: a
title, what it measures, the columns worth showing and rows of named values, so the docs render
any section without knowing it, and a new section needs no new format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: the ``schema`` value of this format; a reader refuses any other
SCHEMA = "omni-plugins-bench/1"

Value = float | int | str | bool | None


class Column(BaseModel):
    """A column of a section's table: the row key, its heading, and how to show its values.

    ``kind``: ``number`` (``digits`` decimals), ``size`` (bytes as ``64KiB``) or ``text``.
    """

    model_config = ConfigDict(extra="forbid")

    key: str
    label: str
    kind: Literal["number", "size", "text"] = "number"
    digits: int = 2

    def show(self, value: Value) -> str:
        """``value`` as the table shows it (``-`` for nothing)."""
        if value is None or value == "":
            return "-"
        if self.kind == "size" and isinstance(value, int):
            from omni_plugins.bench.units import format_size

            return format_size(value)
        if self.kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{value:.{self.digits}f}"
        return str(value)


class Section(BaseModel):
    """One measurement: what it is (``about``), which columns to show, and every row measured."""

    model_config = ConfigDict(extra="forbid")

    title: str
    about: str
    columns: list[Column]
    rows: list[dict[str, Value]] = Field(default_factory=list)
    #: facts of the section's set-up (chunk size, rounds, backend config) worth keeping with the numbers
    setup: dict[str, Value] = Field(default_factory=dict)


class TargetResult(BaseModel):
    """A target checked in the run: its bound, the measured value (the worst where it spans rows) and the verdict.

    ``floor`` is the same measure for the least any implementation has to do, measured in the
    same run (e.g. the raw transfer plus the one copy and the one lookup a connector cannot
    avoid): when the floor itself misses the bound, the target is out of reach here
    (``reachable`` False) and the floor is the proof. A met target is reachable whatever its
    floor says.
    """

    model_config = ConfigDict(extra="forbid")

    section: str
    subject: str
    description: str
    op: Literal[">=", "<="]
    bound: float
    measured: float | None
    #: where the measured (worst) value was taken, e.g. ``"64MiB"`` or ``"32 streams x 64KiB / 2 ms"``
    at: str = ""
    met: bool | None
    floor: float | None = None
    floor_about: str = ""
    reachable: bool | None = None
    note: str = ""


class Machine(BaseModel):
    """The machine a document was measured on; ``load_avg`` before and after show how quiet it was."""

    model_config = ConfigDict(extra="allow")

    platform: str = ""
    python: str = ""
    torch: str = ""
    cpus: int | None = None
    memory_gib: float | None = None
    load_avg_start: list[float] = Field(default_factory=list)
    load_avg_end: list[float] = Field(default_factory=list)


class BenchDocument(BaseModel):
    """A results file."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["omni-plugins-bench/1"] = Field(default="omni-plugins-bench/1", alias="schema")
    command: str = ""
    #: False for a short run (``--quick``): a sanity check of the harness, not figures to quote
    final: bool = False
    machine: Machine = Field(default_factory=Machine)
    sections: dict[str, Section] = Field(default_factory=dict)
    targets: list[TargetResult] = Field(default_factory=list)
    #: what could not be measured here, and why (a backend without its server, the peer without its venv)
    skipped: dict[str, str] = Field(default_factory=dict)

    def table(self, name: str) -> list[list[str]]:
        """Section ``name`` as rows of cells, the header first."""
        section = self.sections[name]
        return [[c.label for c in section.columns]] + [[c.show(r.get(c.key)) for c in section.columns] for r in section.rows]

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def merge(self, other: BenchDocument) -> None:
        """Take ``other``'s sections, targets and skips (a section measured in another process or venv)."""
        self.sections.update(other.sections)
        self.targets += other.targets
        self.skipped.update(other.skipped)


def load_document(path: str | Path) -> BenchDocument:
    """Read and validate a results file (``ValidationError`` for anything not in this format)."""
    return BenchDocument.model_validate_json(Path(path).read_text(encoding="utf-8"))


def is_document(data: Any) -> bool:
    """True for a parsed JSON object in this format's schema."""
    return isinstance(data, dict) and data.get("schema") == SCHEMA
