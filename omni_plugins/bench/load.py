"""The load curve: the runtime under offered load rising from light to past saturation, against the connector alone.

Each point is ``streams`` x ``chunk`` every ``interval`` (:class:`~omni_plugins.bench.traffic.Traffic`);
at each, the runtime and the connector alone move the same traffic between two stage processes,
interleaved point by point and round by round. Reported per point and mode: hand-off p50 and p99,
delivered throughput, CPU per chunk; and the runtime's ratios to the connector alone.

Saturation is where the connector alone stops delivering what is offered (below
:data:`SATURATED` of it); the targets are read against it: the runtime's p50 within 1.3x of the
connector's at up to half that load, its delivered throughput at least 0.8x the connector's from
that load on.

The ``floor`` mode runs in the same rounds (:mod:`~omni_plugins.bench.handoff`): the connector alone
with one thread hand-off per chunk on each side. Its throughput bounds any runtime whose I/O runs
on threads of its own; where the floor cannot carry a point's load, its p50 there is queueing and
bounds the runtime's too. The targets carry those figures as their floors.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.schema import Column, Section, TargetResult, Value
from omni_plugins.bench.targets import check, number
from omni_plugins.bench.traffic import Mode, Traffic, median
from omni_plugins.bench.units import KIB, format_size, parse_size

if TYPE_CHECKING:
    from omni_plugins.bench.runner import BenchOptions
    from omni_plugins.bench.schema import BenchDocument
    from omni_plugins.bench.traffic import StagePair

#: the connector alone is saturated once it delivers less than this fraction of the offered load
SATURATED = 0.85
MODES: tuple[Mode, ...] = ("runtime", "floor", "connector")
FLOOR_ABOUT = (
    "the connector alone with one thread hand-off per chunk on each side (omni_plugins.bench.handoff): "
    "what a runtime whose I/O runs on threads of its own pays at least in CPython"
)


def modes_of(lo: LoadOptions) -> tuple[Mode, ...]:
    """``runtime``, one ``runtime:<name>`` per tuning overlay of ``--tuning``, ``floor``, ``connector``."""
    return ("runtime", *(f"runtime:{name}" for name in lo.tunings), "floor", "connector")


@dataclass
class LoadOptions:
    """The traffic of the load, scaling and peer sections."""

    streams: int = 64
    chunk_bytes: int = 64 * KIB
    intervals_s: list[float] = field(default_factory=lambda: [0.032, 0.016, 0.008, 0.004, 0.002, 0.001, 0.0005, 0.00025])
    #: how long each point runs (per mode and round), bounded by ``budget_bytes``
    seconds: float = 1.0
    budget_bytes: int = 1 << 30
    rounds: int = 3
    per_request: int = 32
    scaling_streams: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])
    #: named :class:`~omni_plugins.runtime.RuntimeTuning` overlays measured as further runtime modes (A/B in the same run)
    tunings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def traffic(self, interval_s: float, streams: int | None = None) -> Traffic:
        n = streams or self.streams
        steps = min(self.seconds / interval_s, self.budget_bytes / (n * self.chunk_bytes))
        steps = max(self.per_request, int(steps) // self.per_request * self.per_request)
        return Traffic(n, self.chunk_bytes, interval_s, steps, self.per_request)


def load_options(
    streams: int | None,
    chunk: str | None,
    intervals_ms: str | None,
    scaling: str | None,
    quick: bool,
    tunings: dict[str, dict[str, Any]] | None = None,
) -> LoadOptions:
    """The options from the command line (``ValueError`` naming the option that is wrong)."""
    from omni_plugins.runtime import RuntimeTuning

    opts = LoadOptions()
    for name, overlay in (tunings or {}).items():
        if not name.isidentifier():
            raise ValueError(f"--tuning {name!r}: a name is letters, digits and underscores")
        try:
            RuntimeTuning(**overlay)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--tuning {name}: not RuntimeTuning fields: {exc}") from None
        opts.tunings[name] = dict(overlay)
    if quick:
        opts.intervals_s, opts.seconds, opts.rounds, opts.per_request = [0.016, 0.004, 0.001], 0.3, 1, 8
        opts.scaling_streams = [16, 64, 256]
    if streams is not None:
        if streams <= 0:
            raise ValueError("--streams must be positive")
        opts.streams = streams
    if chunk is not None:
        try:
            opts.chunk_bytes = parse_size(chunk)
        except ValueError as exc:
            raise ValueError(f"--chunk: {exc}") from None
        if opts.chunk_bytes < 4:
            raise ValueError("--chunk must be at least 4 bytes")
    if intervals_ms is not None:
        try:
            opts.intervals_s = sorted((float(x) / 1e3 for x in intervals_ms.split(",") if x.strip()), reverse=True)
        except ValueError:
            raise ValueError(f"--intervals-ms: expected numbers of milliseconds, e.g. 16,4,1; got {intervals_ms!r}") from None
        if not opts.intervals_s or min(opts.intervals_s) <= 0:
            raise ValueError("--intervals-ms needs positive intervals")
    if scaling is not None:
        try:
            opts.scaling_streams = [int(x) for x in scaling.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--scaling-streams: expected stream counts, e.g. 16,64,256; got {scaling!r}") from None
        if not opts.scaling_streams or min(opts.scaling_streams) <= 0:
            raise ValueError("--scaling-streams needs positive counts")
    return opts


LOAD_COLUMNS = [
    Column(key="point", label="traffic", kind="text"),
    Column(key="mode", label="mode", kind="text"),
    Column(key="offered_gbps", label="offered GB/s", digits=3),
    Column(key="delivered_gbps", label="delivered GB/s", digits=3),
    Column(key="p50_ms", label="p50 ms", digits=3),
    Column(key="p99_ms", label="p99 ms", digits=3),
    Column(key="cpu_us_per_chunk", label="CPU us/chunk", digits=1),
    Column(key="p50_vs_connector", label="p50 / connector"),
    Column(key="p99_vs_connector", label="p99 / connector"),
    Column(key="delivered_vs_connector", label="delivered / connector"),
    Column(key="delivered_vs_floor", label="delivered / floor"),
    Column(key="missing", label="missing", digits=0),
]

LOAD_ABOUT = (
    "The runtime (send_chunk on the producer's model thread to recv_chunk on the consumer's) and the "
    "connector alone (put as each chunk is made; one consumer thread on wait_any + get) move the same "
    "traffic between two stage processes: every stream emits a chunk every interval, all in the same "
    "step, and a request finishes after a fixed number of chunks and the next takes its place. p50 and "
    "p99 are the hand-off from the chunk made to the consumer holding it (median over rounds); "
    "delivered = bytes that arrived / time from the first send to the last arrival. The connector alone "
    f"is saturated where it delivers less than {SATURATED:.0%} of the offered load. floor: the connector "
    "alone with one thread hand-off per chunk on each side (a SimpleQueue from the producer's model thread "
    "to a send thread, and from a receive thread to the consumer's), nothing else: no runtime whose I/O "
    "runs on threads of its own delivers more in CPython, where the threads take turns with the GIL."
)


def run_load(opts: BenchOptions, doc: BenchDocument, bar: Any) -> None:
    from omni_plugins.bench.runner import Skip, prepared_backend
    from omni_plugins.bench.traffic import StagePair

    lo = opts.load
    backend = opts.runtime_backend
    assert lo is not None and backend is not None
    points = [lo.traffic(i) for i in lo.intervals_s]
    section = doc.sections.setdefault("load", Section(title="Load curve", about=LOAD_ABOUT, columns=LOAD_COLUMNS))
    section.setup.update(
        {"backend": backend, "streams": lo.streams, "chunk_bytes": lo.chunk_bytes, "per_request": lo.per_request, "rounds": lo.rounds}
    )
    modes = modes_of(lo)
    got: dict[tuple[int, Mode], list[dict[str, float]]] = {(p, m): [] for p in range(len(points)) for m in modes}
    bar.total += len(points) * len(modes) * lo.rounds
    try:
        with prepared_backend(backend, opts.configs, in_flight_bytes(lo.streams, lo.chunk_bytes)) as prepared:
            pair = StagePair()
            try:
                warm_up(pair, backend, prepared.config, points[0])
                for rnd in range(lo.rounds):
                    for p, traffic in enumerate(points):
                        bar.set_postfix_str(f"load: {traffic.label()}")
                        for mode in modes if rnd % 2 == 0 else modes[::-1]:
                            tuning = lo.tunings.get(mode.partition(":")[2])
                            got[(p, mode)].append(
                                pair.run_traffic(mode, backend, prepared.config, traffic, f"ld{uuid.uuid4().hex[:8]}", tuning)
                            )
                            bar.update(1)
            finally:
                pair.close()
    except Skip as exc:
        doc.skipped[f"load: {backend}"] = str(exc)
        return
    section.rows += load_rows(points, got, modes)
    doc.targets += load_targets(section.rows)


def warm_up(pair: StagePair, backend: str, config: dict[str, Any], like: Traffic, modes: tuple[Mode, ...] = MODES) -> None:
    """One short unrecorded job per mode: each stage process imports and maps what it needs once."""
    short = Traffic(like.streams, like.chunk_bytes, 0.004, like.per_request, like.per_request)
    for mode in modes:
        pair.run_traffic(mode, backend, config, short, f"wu{uuid.uuid4().hex[:8]}")


def in_flight_bytes(streams: int, chunk_bytes: int) -> int:
    """What the backend is sized for in the runtime sections: 16 steps of every stream's chunk in flight."""
    return max(streams * chunk_bytes * 16, 1 << 20)


def load_rows(
    points: list[Traffic], got: dict[tuple[int, Mode], list[dict[str, float]]], modes: tuple[Mode, ...] = MODES
) -> list[dict[str, Value]]:
    rows: list[dict[str, Value]] = []
    for p, traffic in enumerate(points):
        per_mode = {}
        mode_rows = {}
        for mode in modes:
            runs = got[(p, mode)]
            figures = {k: median([r[k] for r in runs]) for k in ("p50_ms", "p99_ms", "delivered_gbps", "sent_gbps", "cpu_us_per_chunk")}
            per_mode[mode] = figures
            row: dict[str, Value] = {
                "point": traffic.label(),
                "mode": mode,
                "streams": traffic.streams,
                "chunk_bytes": traffic.chunk_bytes,
                "interval_ms": traffic.interval_s * 1e3,
                "chunks": traffic.chunks,
                "offered_gbps": traffic.offered_gbps,
                **figures,
                "missing": sum(r["missing"] for r in runs),
                "rounds": len(runs),
            }
            rows.append(row)
            mode_rows[mode] = row
        for mode, row in mode_rows.items():
            if mode == "connector":
                continue
            for key, ratio_key in (
                ("p50_ms", "p50_vs_connector"),
                ("p99_ms", "p99_vs_connector"),
                ("delivered_gbps", "delivered_vs_connector"),
            ):
                a, b = per_mode[mode][key], per_mode["connector"][key]
                row[ratio_key] = a / b if b else None
            if mode != "floor" and "floor" in per_mode:
                a, b = per_mode[mode]["delivered_gbps"], per_mode["floor"]["delivered_gbps"]
                row["delivered_vs_floor"] = a / b if b else None
    return rows


def saturating_load(rows: list[dict[str, Value]]) -> float | None:
    """The lowest offered load (GB/s) at which the connector alone delivered less than :data:`SATURATED` of it."""
    for row in sorted((r for r in rows if r["mode"] == "connector"), key=lambda r: number(r["offered_gbps"]) or 0.0):
        offered, delivered = number(row["offered_gbps"]), number(row["delivered_gbps"])
        if offered is not None and delivered is not None and delivered < SATURATED * offered:
            return offered
    return None


def load_targets(rows: list[dict[str, Value]]) -> list[TargetResult]:
    """The runtime's two load targets, with the floor's figures where the floor bounds them.

    The throughput floor is the floor mode's delivered / connector at each saturated point. The p50
    floor is its p50 / connector only at light points the floor itself could not carry (delivered
    below :data:`SATURATED` of the offer): there its p50 is queueing that no runtime of its shape
    avoids; where it carried the load, its p50 depends on how the hand-off is done and bounds nothing.
    """
    saturation = saturating_load(rows)
    runtime = [r for r in rows if r["mode"] == "runtime"]
    floor_rows = {str(r["point"]): r for r in rows if r["mode"] == "floor"}
    offered = {str(r["point"]): number(r["offered_gbps"]) or 0.0 for r in runtime}
    light_limit = 0.5 * (saturation if saturation is not None else max(offered.values(), default=0.0))
    light, heavy = [], []
    light_floors: dict[str, float] = {}
    heavy_floors: dict[str, float] = {}
    for r in runtime:
        point = str(r["point"])
        p50, delivered = number(r.get("p50_vs_connector")), number(r.get("delivered_vs_connector"))
        floor = floor_rows.get(point, {})
        floor_p50, floor_delivered = number(floor.get("p50_vs_connector")), number(floor.get("delivered_vs_connector"))
        if p50 is not None and offered[point] <= light_limit:
            light.append((point, p50))
            carried = number(floor.get("delivered_gbps"))
            if floor_p50 is not None and carried is not None and carried < SATURATED * offered[point]:
                light_floors[point] = floor_p50
        if delivered is not None and saturation is not None and offered[point] >= saturation:
            heavy.append((point, delivered))
            if floor_delivered is not None:
                heavy_floors[point] = floor_delivered
    where = f"saturation at {saturation:.3g} GB/s offered" if saturation is not None else ""
    return [
        check(
            section="load",
            subject="runtime",
            description="hand-off p50 <= 1.3x the connector alone under the same traffic, up to 50% of the saturating load",
            op="<=",
            bound=1.3,
            values=light,
            floors=light_floors or None,
            floor_about=FLOOR_ABOUT + "; given only where the floor could not carry the offered load" if light_floors else "",
            note=where or "no point saturated the connector alone: half the highest offered load stands in",
        ),
        check(
            section="load",
            subject="runtime",
            description="delivered throughput >= 0.8x the connector alone's at saturation",
            op=">=",
            bound=0.8,
            values=heavy,
            floors=heavy_floors or None,
            floor_about=FLOOR_ABOUT if heavy_floors else "",
            note=where or "no point saturated the connector alone: add shorter --intervals-ms",
        ),
    ]


def describe(traffic: Traffic) -> str:
    return f"{traffic.streams} streams x {format_size(traffic.chunk_bytes)} every {traffic.interval_s * 1e3:g} ms"
