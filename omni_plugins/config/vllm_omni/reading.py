"""The state of reading one vLLM-Omni file: what it says, where, and what the reading found."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_plugins.config.yamldoc import Loc


@dataclass
class StageRecord:
    """One stage of the file as omni-plugins reads it, before the stage list is assembled."""

    #: its location in the (merged) document
    loc: Loc
    stage_id: Any
    #: omni-plugins' fields of the stage
    native: dict[str, Any] = field(default_factory=dict)
    #: path inside ``native`` -> where it was read from in the document
    moves: dict[Loc, Loc] = field(default_factory=dict)
    #: vLLM-Omni settings omni-plugins does not use: key -> (value, location)
    unused: dict[str, tuple[Any, Loc]] = field(default_factory=dict)
    #: prefill / decode flags (``is_prefill_only``, ``is_decode_only``): key -> (value, location)
    flags: dict[str, tuple[Any, Loc]] = field(default_factory=dict)
    #: a stage that is not a mapping, passed on as written (the stage model reports it)
    raw: Any = None
    passthrough: bool = False

    def set(self, key: str, value: Any, at: Loc) -> None:
        self.native[key] = value
        self.moves[(key,)] = at

    def label(self) -> str:
        return f"stage {self.stage_id}"


@dataclass
class Reading:
    """Problems (errors: each names file, line and field) and notes (for the warning) of one file."""

    filename: str
    #: ``file:line: path`` of a location in the (merged) document
    where: Callable[[Loc], str]
    #: the file is in the legacy layout (``stage_args``); else the deploy layout
    legacy: bool
    problems: list[str] = field(default_factory=list)
    #: pipeline-wide settings omni-plugins does not use: name -> value
    unused: dict[str, Any] = field(default_factory=dict)
    #: connector settings no backend uses: ``instance: key (why)``
    unused_connector_keys: list[str] = field(default_factory=list)
    #: other things a user should know (a platform section ignored, an edge end overridden ...)
    notes: list[str] = field(default_factory=list)
    #: keys that look like a misspelling of a setting omni-plugins reads
    near_misses: list[str] = field(default_factory=list)

    def problem(self, loc: Loc, message: str) -> None:
        self.problems.append(f"{self.where(loc)}: {message}")
