"""Targets: bounds on same-run measures, checked in every run and written into its document.

A backend's plugin declares the targets of its size curve (``ConnectorServices.bench_targets``,
a tuple of :class:`SizeTarget`); the runtime's targets are the core's own (the load, scaling and
peer sections check them). A target spanning several rows (every size from 64 KiB up) is met
when every row meets it; its measured value is the worst row's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from omni_plugins.bench.schema import TargetResult, Value
from omni_plugins.bench.units import format_size

#: size-curve measures (row keys of the sizes section) and which way is better
SIZE_MEASURES: dict[str, Literal[">=", "<="]] = {
    "ratio": ">=",  # raw put+get time / connector put+get time: 1.0 = as fast as raw
    "put_ratio": ">=",  # raw put time / connector put time
    "get_ratio": ">=",  # raw get time / connector get time
    "cost": "<=",  # connector put+get time / raw put+get time (1 / ratio)
    "round_trip_vs_pipe": "<=",  # connector round trip / the same bytes there and back over a pipe
}


@dataclass(frozen=True)
class SizeTarget:
    """A bound on one measure of the size curve, over a range of sizes.

    Attributes:
        description: what it says, for people (``"64 MiB put >= 5x raw SET"``).
        measure: a key of :data:`SIZE_MEASURES`; ``>=`` measures are met at or above ``bound``,
            ``<=`` ones at or below.
        bound: the bound.
        min_size / max_size: the sizes it covers (bytes, inclusive; ``max_size`` None: no upper end).
        variant: a name of ``bench_variants`` (the connector with that config overlay); ``""``: the
            connector as configured.
    """

    description: str
    measure: str
    bound: float
    min_size: int = 0
    max_size: int | None = None
    variant: str = ""

    def __post_init__(self) -> None:
        if self.measure not in SIZE_MEASURES:
            raise ValueError(f"unknown measure {self.measure!r}; one of {', '.join(SIZE_MEASURES)}")
        if self.bound <= 0:
            raise ValueError("bound must be positive")

    @property
    def op(self) -> Literal[">=", "<="]:
        return SIZE_MEASURES[self.measure]

    def covers(self, size: int) -> bool:
        return size >= self.min_size and (self.max_size is None or size <= self.max_size)


def holds(value: float | None, op: str, bound: float) -> bool | None:
    """Whether ``value op bound`` (None when nothing was measured)."""
    if value is None:
        return None
    return value >= bound if op == ">=" else value <= bound


def worst(values: Iterable[tuple[str, float]], op: str) -> tuple[str, float] | None:
    """The ``(where, value)`` furthest on the bad side of ``op``."""
    pairs = list(values)
    if not pairs:
        return None
    return min(pairs, key=lambda p: p[1]) if op == ">=" else max(pairs, key=lambda p: p[1])


def check(
    *,
    section: str,
    subject: str,
    description: str,
    op: Literal[">=", "<="],
    bound: float,
    values: Iterable[tuple[str, float]],
    floors: Mapping[str, float] | None = None,
    floor_about: str = "",
    note: str = "",
) -> TargetResult:
    """A :class:`TargetResult` from ``(where, value)`` pairs (and the same-run floor at each ``where``)."""
    found = worst(values, op)
    where, measured = found if found is not None else ("", None)
    met = holds(measured, op, bound)
    floor: float | None = None
    reachable: bool | None = None
    if floors:
        # reachable if met (whatever a floor says: one that misses a bound the connector meets bounds
        # nothing there), else only if the floor meets the bound everywhere; shown where the measured value is worst
        reachable = met or all(holds(f, op, bound) for f in floors.values())
        hardest = worst(floors.items(), op)
        floor = floors[where] if where in floors else (hardest[1] if hardest is not None else None)
    return TargetResult(
        section=section,
        subject=subject,
        description=description,
        op=op,
        bound=bound,
        measured=measured,
        at=where,
        met=met,
        floor=floor,
        floor_about=floor_about,
        reachable=reachable,
        note=note,
    )


def check_size_target(target: SizeTarget, backend: str, rows: list[dict[str, Value]], floor_about: str = "") -> TargetResult:
    """Check a plugin's size target against the sizes section's rows of ``backend``."""
    mine = [r for r in rows if r.get("backend") == backend and r.get("variant", "") == target.variant]
    values, floors = [], {}
    for r in mine:
        size = r.get("size")
        if not isinstance(size, int) or not target.covers(size):
            continue
        value = r.get(target.measure)
        if isinstance(value, (int, float)):
            values.append((format_size(size), float(value)))
        floor = r.get(f"floor_{target.measure}")
        if isinstance(floor, (int, float)):
            floors[format_size(size)] = float(floor)
    subject = backend + (f" ({target.variant})" if target.variant else "")
    note = "" if values else "no measured size in the target's range"
    return check(
        section="sizes",
        subject=subject,
        description=target.description,
        op=target.op,
        bound=target.bound,
        values=values,
        floors=floors or None,
        floor_about=floor_about if floors else "",
        note=note,
    )


def number(value: Any) -> float | None:
    """``value`` as a float, None for anything that is not a number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
