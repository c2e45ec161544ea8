"""Targets: the worst value decides, floors tell what is reachable, the load's saturation point is found."""

from __future__ import annotations

from typing import Any

import pytest

from omni_plugins.bench.load import load_targets, saturating_load
from omni_plugins.bench.peer import peer_targets
from omni_plugins.bench.scaling import flatness_target
from omni_plugins.bench.targets import SizeTarget, check, check_size_target


def test_the_worst_value_is_the_measured_one() -> None:
    t = check(section="s", subject="x", description="d", op=">=", bound=0.9, values=[("4KiB", 1.2), ("1MiB", 0.7), ("64MiB", 3.0)])
    assert (t.measured, t.at, t.met) == (0.7, "1MiB", False)
    t = check(section="s", subject="x", description="d", op="<=", bound=1.5, values=[("a", 1.1), ("b", 1.4)])
    assert (t.measured, t.at, t.met) == (1.4, "b", True)


def test_nothing_measured_is_neither_met_nor_missed() -> None:
    t = check(section="s", subject="x", description="d", op=">=", bound=1, values=[])
    assert t.measured is None and t.met is None


def _floored(bound: float, values: list[tuple[str, float]], floors: dict[str, float]) -> Any:
    return check(section="s", subject="x", description="d", op=">=", bound=bound, values=values, floors=floors)


def test_a_floor_that_misses_the_bound_marks_the_target_out_of_reach() -> None:
    t = _floored(0.9, [("64KiB", 0.3), ("1MiB", 0.5)], {"64KiB": 0.6, "1MiB": 0.95})
    assert t.met is False and t.at == "64KiB" and t.floor == 0.6 and t.reachable is False
    t = _floored(0.9, [("1MiB", 0.5)], {"1MiB": 0.95})
    assert t.floor == 0.95 and t.reachable is True
    # a met target is reachable, even where a floor misses the bound (that floor bounds nothing there)
    t = _floored(0.8, [("16MiB", 2.2), ("256MiB", 2.5)], {"16MiB": 1.0, "256MiB": 0.2})
    assert t.met is True and t.reachable is True


def _row(size: int, variant: str = "", **values: float) -> dict[str, Any]:
    return {"backend": "b", "variant": variant, "size": size, **values}


def test_a_size_target_reads_its_variant_and_sizes() -> None:
    rows = [_row(4096, ratio=0.5), _row(1 << 20, ratio=0.95, floor_ratio=1.2), _row(1 << 20, "views", ratio=2.0), _row(64 << 20, ratio=0.8)]
    t = check_size_target(SizeTarget("from 1 MiB", "ratio", 0.9, min_size=1 << 20), "b", rows)
    assert (t.measured, t.at, t.met) == (0.8, "64MiB", False)
    t = check_size_target(SizeTarget("views", "ratio", 1.5, variant="views"), "b", rows)
    assert (t.measured, t.met, t.subject) == (2.0, True, "b (views)")
    t = check_size_target(SizeTarget("huge", "ratio", 1.0, min_size=1 << 30), "b", rows)
    assert t.met is None and "no measured size" in t.note


def _load_row(
    point: str, mode: str, offered: float, delivered: float, p50_ratio: float | None = None, tput: float | None = None
) -> dict[str, Any]:
    row: dict[str, Any] = {"point": point, "mode": mode, "offered_gbps": offered, "delivered_gbps": delivered}
    if mode == "runtime":
        row |= {"p50_vs_connector": p50_ratio, "delivered_vs_connector": tput}
    return row


def test_the_load_targets_read_against_the_connector_alones_saturation() -> None:
    rows = []
    for point, offered, delivered, p50, tput in (
        ("a", 0.25, 0.25, 1.1, 1.0),
        ("b", 0.5, 0.5, 1.2, 1.0),
        ("c", 1.0, 0.95, 2.0, 0.9),
        ("d", 2.0, 1.0, 5.0, 0.7),
    ):
        rows += [_load_row(point, "runtime", offered, delivered, p50, tput), _load_row(point, "connector", offered, delivered)]
    assert saturating_load(rows) == 2.0  # the first point where the connector delivers < 85 % of the offer
    light, heavy = load_targets(rows)
    assert (light.measured, light.at, light.met) == (2.0, "c", False)  # up to half of 2.0 GB/s: a, b and c
    assert (heavy.measured, heavy.at, heavy.met) == (0.7, "d", False)


def test_the_floor_bounds_throughput_at_saturation_and_p50_only_where_it_could_not_carry_the_load() -> None:
    rows = []
    for point, offered, delivered, floor_delivered, floor_p50, floor_tput in (
        ("a", 0.25, 0.25, 0.25, 1.6, 1.0),  # the floor carried it: its p50 bounds nothing
        ("b", 1.0, 1.0, 0.5, 300.0, 0.5),  # the floor could not: its p50 is queueing
        ("c", 2.0, 1.0, 0.4, 200.0, 0.4),
    ):
        rows += [
            _load_row(point, "runtime", offered, delivered, 1.1 if point == "a" else 280.0, 0.45),
            _load_row(point, "connector", offered, offered if point != "c" else 1.0),
            {
                "point": point,
                "mode": "floor",
                "offered_gbps": offered,
                "delivered_gbps": floor_delivered,
                "p50_vs_connector": floor_p50,
                "delivered_vs_connector": floor_tput,
            },
        ]
    light, heavy = load_targets(rows)
    assert (light.at, light.met, light.floor, light.reachable) == ("b", False, 300.0, False)
    assert (heavy.at, heavy.floor, heavy.reachable) == ("c", 0.4, False) and "hand-off" in heavy.floor_about
    # a floor that carried every light point gives the p50 target no floor at all
    carried = [r for r in rows if r["point"] != "b"]
    light, _ = load_targets(carried)
    assert light.floor is None and light.reachable is None


def test_without_saturation_the_throughput_target_is_not_measured() -> None:
    rows = [_load_row("a", "runtime", 0.1, 0.1, 1.0, 1.0), _load_row("a", "connector", 0.1, 0.1)]
    rows += [_load_row("b", "runtime", 0.2, 0.2, 2.0, 1.0), _load_row("b", "connector", 0.2, 0.2)]
    light, heavy = load_targets(rows)
    assert (light.measured, light.met) == (1.0, True)  # half the highest offer stands in for the saturating load
    assert heavy.met is None and "shorter --intervals-ms" in heavy.note


def test_flat_means_highest_over_lowest() -> None:
    t = flatness_target([{"streams": n, "runtime_cpu_us_per_chunk": c} for n, c in ((16, 100.0), (64, 80.0), (256, 120.0))])
    assert t.measured == pytest.approx(1.5) and t.met is False and "256 streams over 64 streams" in t.at
    assert t.note == ""


def test_flatness_notes_the_connector_alones_spread_between_the_same_stream_counts() -> None:
    rows = [
        {"streams": n, "runtime_cpu_us_per_chunk": c, "connector_cpu_us_per_chunk": k}
        for n, c, k in ((16, 100.0, 20.0), (1024, 110.0, 30.0))
    ]
    t = flatness_target(rows)
    assert t.measured == pytest.approx(1.1) and t.met is True and "1.5x" in t.note


def test_the_peer_targets_are_ours_over_theirs() -> None:
    rows: list[dict[str, Any]] = [
        {"what": "runtime hand-off", "point": "p", "ours_p50_ms": 1.0, "peer_p50_ms": 4.0, "ours_p99_ms": 3.0, "peer_p99_ms": 4.0}
    ]
    p50, p99 = peer_targets(rows)
    assert (p50.measured, p50.met) == (0.25, True) and (p99.measured, p99.met) == (0.75, False)
