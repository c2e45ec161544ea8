"""Scaling: the runtime's cost per chunk and its memory per in-flight request as concurrent streams grow.

Cost per chunk: the load section's traffic (two stage processes, the runtime and the connector
alone) at each stream count with everything but the number of streams held constant: a model
step every :data:`STEP_S`, :data:`PER_STEP` chunks of :data:`CHUNK_BYTES` in each (a window of
streams rotating through all of them, so each stream emits less often as streams grow, like
requests at different positions of their output); CPU of both stage processes per delivered
chunk. Holding the steps constant matters: the runtime has costs per step (waking its threads,
one lock round per batch) that a step of more chunks spreads thinner, so steps that grew with the
streams would show a per-chunk cost falling as streams grow and hide one that grows with them. Memory: in this process, a producing
and a consuming runtime over the in-process ``memory`` connector with ``n`` requests in flight
(each registered, one chunk sent and received, not finished); the Python memory both runtimes
hold (``tracemalloc``: their per-request state, not tensor storage) divided by ``n``, and what a
round of ``n`` requests leaves once every request was cleaned up.

The two stage processes run on a CPU each (where the machine has two and lets the bench pin):
left to the OS, they share one CPU in some jobs and not in others, which moves the runtime's cost
per chunk from one job to the next by more than the flatness bound, whatever the number of streams (a crossing between
threads costs more while the other stage's threads run on the same CPU), and the comparison
between stream counts would measure the placement. The section's setup says whether they were.
"""

from __future__ import annotations

import gc
import math
import time
import tracemalloc
import uuid
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.schema import Column, Section, TargetResult, Value
from omni_plugins.bench.targets import check, number
from omni_plugins.bench.traffic import BUILDER, Mode, Traffic, _Request, median

if TYPE_CHECKING:
    from omni_plugins.bench.runner import BenchOptions
    from omni_plugins.bench.schema import BenchDocument

#: a model step every this many seconds (both modes, every stream count) ...
STEP_S = 0.004
#: ... with this many chunks in it (4000 chunks/s: light enough that nothing queues)
PER_STEP = 16
#: small chunks: the cost per chunk, not per byte
CHUNK_BYTES = 4096
MODES: tuple[Mode, ...] = ("runtime", "connector")

SCALING_COLUMNS = [
    Column(key="streams", label="streams", digits=0),
    Column(key="runtime_cpu_us_per_chunk", label="runtime CPU us/chunk", digits=1),
    Column(key="connector_cpu_us_per_chunk", label="connector alone CPU us/chunk", digits=1),
    Column(key="runtime_overhead_us_per_chunk", label="runtime overhead us/chunk", digits=1),
    Column(key="runtime_p50_ms", label="runtime p50 ms", digits=3),
    Column(key="connector_p50_ms", label="connector p50 ms", digits=3),
    Column(key="bytes_per_request", label="bytes per in-flight request", digits=0),
    Column(key="bytes_left", label="bytes a round leaves", digits=0),
]

SCALING_ABOUT = (
    f"Cost per chunk: a step every {STEP_S * 1e3:g} ms with {PER_STEP} chunks of {CHUNK_BYTES // 1024} KiB in it at "
    "every stream count (a window of streams rotating through all of them: each stream emits less often as streams "
    "grow), the runtime and the connector alone between two stage processes; CPU of both processes per delivered "
    "chunk (median over rounds); overhead = runtime - connector alone. Memory: a producing and a "
    "consuming runtime in one process over the in-process memory connector with every request in flight "
    "(registered, one chunk sent and received, not finished): the Python memory they hold per request "
    "(tracemalloc; tensor storage not included), measured in a second round of as many requests, and what that "
    "round leaves once every request was cleaned up (tables keep their capacity from the first round). "
    "Each stage process runs on a CPU of its own (setup: stages_pinned): where the OS places them moves the "
    "runtime's cost per chunk between jobs by more than the flatness bound, whatever the number of streams."
)


def traffic_for(streams: int, seconds: float, per_request: int) -> Traffic:
    """``streams`` concurrent streams, :data:`PER_STEP` of them emitting per step, for about ``seconds``
    (at least long enough for every stream to finish one request)."""
    per_step = min(PER_STEP, streams)
    cycle = streams * per_request // math.gcd(streams * per_request, per_step)  # steps in which every request ends
    steps = max(1, round(seconds / STEP_S / cycle)) * cycle
    return Traffic(streams, CHUNK_BYTES, STEP_S, steps, per_request, per_step=per_step)


def run_scaling(opts: BenchOptions, doc: BenchDocument, bar: Any) -> None:
    from omni_plugins.bench.load import in_flight_bytes, warm_up
    from omni_plugins.bench.runner import Skip, prepared_backend
    from omni_plugins.bench.traffic import StagePair

    lo = opts.load
    backend = opts.runtime_backend
    assert lo is not None and backend is not None
    per_request = 4
    counts = sorted(lo.scaling_streams)
    section = doc.sections.setdefault("scaling", Section(title="Scaling with streams", about=SCALING_ABOUT, columns=SCALING_COLUMNS))
    section.setup.update(
        {"backend": backend, "chunk_bytes": CHUNK_BYTES, "step_ms": STEP_S * 1e3, "per_step": PER_STEP, "rounds": lo.rounds}
    )
    seconds = max(1.5 * lo.seconds, counts[-1] * per_request / PER_STEP * STEP_S)
    got: dict[tuple[int, Mode], list[dict[str, float]]] = {(n, m): [] for n in counts for m in MODES}
    bar.total += len(counts) * (len(MODES) * lo.rounds + 1)
    try:
        with prepared_backend(backend, opts.configs, in_flight_bytes(counts[-1], CHUNK_BYTES)) as prepared:
            pair = StagePair(pinned=True)
            section.setup["stages_pinned"] = pair.pinned
            try:
                warm_up(pair, backend, prepared.config, traffic_for(counts[0], seconds, per_request))
                for rnd in range(lo.rounds):
                    for n in counts:
                        bar.set_postfix_str(f"scaling: {n} streams")
                        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                            got[(n, mode)].append(
                                pair.run_traffic(
                                    mode, backend, prepared.config, traffic_for(n, seconds, per_request), f"sc{uuid.uuid4().hex[:8]}"
                                )
                            )
                            bar.update(1)
            finally:
                pair.close()
    except Skip as exc:
        doc.skipped[f"scaling: {backend}"] = str(exc)
        return
    rows: list[dict[str, Value]] = []
    for n in counts:
        runtime = {k: median([r[k] for r in got[(n, "runtime")]]) for k in ("cpu_us_per_chunk", "p50_ms")}
        connector = {k: median([r[k] for r in got[(n, "connector")]]) for k in ("cpu_us_per_chunk", "p50_ms")}
        per_request_bytes, left = memory_per_request(n)
        bar.update(1)
        rows.append(
            {
                "streams": n,
                "runtime_cpu_us_per_chunk": runtime["cpu_us_per_chunk"],
                "connector_cpu_us_per_chunk": connector["cpu_us_per_chunk"],
                "runtime_overhead_us_per_chunk": runtime["cpu_us_per_chunk"] - connector["cpu_us_per_chunk"],
                "runtime_p50_ms": runtime["p50_ms"],
                "connector_p50_ms": connector["p50_ms"],
                "bytes_per_request": per_request_bytes,
                "bytes_left": left,
                "missing": sum(r["missing"] for m in MODES for r in got[(n, m)]),
            }
        )
    section.rows += rows
    doc.targets.append(flatness_target(rows))


def flatness_target(rows: list[dict[str, Value]]) -> TargetResult:
    """The runtime's CPU per chunk, highest over lowest across the stream counts: within 1.3x.

    The note gives the connector alone's spread between the same stream counts: what of the
    runtime's comes with the connector it runs over.
    """
    spread, note = [], ""
    pair = _spread(rows, "runtime_cpu_us_per_chunk")
    if pair is not None:
        low, high = pair
        spread = [(f"{high['streams']} streams over {low['streams']} streams", _ratio(high, low, "runtime_cpu_us_per_chunk"))]
        connector = _ratio(high, low, "connector_cpu_us_per_chunk")
        if connector is not None:
            note = f"the connector alone: {connector:.3g}x between the same stream counts"
    span = f"from {rows[0]['streams']} to {rows[-1]['streams']} streams" if rows else ""
    return check(
        section="scaling",
        subject="runtime",
        description=f"CPU per chunk flat (highest / lowest within 1.3x) {span}".rstrip(),
        op="<=",
        bound=1.3,
        values=[(where, v) for where, v in spread if v is not None],
        note=note,
    )


def _spread(rows: list[dict[str, Value]], key: str) -> tuple[dict[str, Value], dict[str, Value]] | None:
    """The rows with the lowest and the highest positive ``key`` (None with fewer than two)."""
    costs = [row for row in rows if (c := number(row.get(key))) is not None and c > 0]
    if len(costs) < 2:
        return None
    return min(costs, key=lambda r: number(r[key]) or 0.0), max(costs, key=lambda r: number(r[key]) or 0.0)


def _ratio(high: dict[str, Value], low: dict[str, Value], key: str) -> float | None:
    a, b = number(high.get(key)), number(low.get(key))
    return a / b if a is not None and b else None


def memory_per_request(n: int) -> tuple[float, float]:
    """Python bytes both runtimes hold per in-flight request with ``n`` of them, and bytes a round of ``n`` requests leaves.

    Two rounds of ``n`` requests each (registered, one chunk sent and received, cleaned up): the
    first sizes every table; what the second leaves beyond the first is what requests leave
    behind (their per-request state; tables keep their capacity either way).
    """
    import torch

    from omni_plugins import StageConfig, create_connector
    from omni_plugins.runtime import StageTransferRuntime

    namespace = f"bench-mem-{uuid.uuid4().hex[:8]}"
    producer = StageTransferRuntime(
        StageConfig(stage_id=0, async_chunk=True, custom_process_next_stage_input_func=BUILDER),
        connector=create_connector("memory", {"namespace": namespace}),
    )
    consumer = StageTransferRuntime(
        StageConfig(stage_id=1, async_chunk=True, recv_timeout_s=60), connector=create_connector("memory", {"namespace": namespace})
    )
    chunk = torch.zeros(4)
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()

    def one_round(tag: str) -> tuple[int, int]:
        """(bytes held with every request in flight, bytes after cleanup), both over the round's start."""
        requests = [_Request(f"mem-{tag}-{i}") for i in range(n)]
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for req in requests:
            consumer.register_chunk_recv(req)
            producer.send_chunk(req, {"chunk": {"data": chunk}, "ts": {"send": [time.monotonic()]}})
        producer.wait_sends(60)
        have: set[str] = set()
        deadline = time.monotonic() + 60
        while len(have) < n and time.monotonic() < deadline:
            consumer.wait_ready(0.05)
            have |= consumer.recv_chunk().keys()
            have |= consumer.collect_signals().chunk_ready
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        for req in requests:
            producer.cleanup_finished_request(req.request_id)
            consumer.cleanup_finished_request(req.request_id)
        producer.wait_sends(10)
        time.sleep(0.2)  # the I/O threads book what the cleanups left them (a deferred release, a cleanup backlog)
        gc.collect()
        return held, tracemalloc.get_traced_memory()[0] - base

    try:
        one_round("a")
        held, left = one_round("b")
    finally:
        producer.shutdown()
        consumer.shutdown()
        if started:
            tracemalloc.stop()
    return held / n, float(max(left, 0))
