"""Topologies: the same streams through a fan-out and a fan-in pipeline against a chain, and the connector alone under each.

Graphs: ``chain`` (0 -> 1), ``fanout`` (0 -> 1 and 2: every chunk to both) and ``fanin`` (0 and 1
-> 2: every stream from both sources), each stage in its own process, every edge on the runtime
backend; the runtime of each stage is built from the pipeline (``StageTransferRuntime.from_pipeline``).
``raw_*``: the connector alone under the graph's traffic (as soon as a chunk is made, a ``put``,
or for a fan-out one ``put_many`` to every destination, as the runtime makes; one consumer thread
on ``wait_any`` over every next key, the keys the runtime would use). Per mode: hand-off p50 / p99
per delivered chunk, the stages' CPU per delivered chunk and the producers' ``put_many`` calls
(a fan-out's payload encoded once for both destinations where the backend can); ratios against
the chain and against the connector alone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.schema import Column, Section, TargetResult, Value
from omni_plugins.bench.targets import check, number
from omni_plugins.bench.traffic import BUILDER, GRACE_S, Traffic, _Request, _sleep_until, percentile

if TYPE_CHECKING:
    from omni_plugins.bench.runner import BenchOptions
    from omni_plugins.bench.schema import BenchDocument

MODES = ("chain", "fanout", "fanin", "raw_chain", "raw_fanout", "raw_fanin")


def graph(mode: str) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """``(edges, producer stages, consumer stages)`` of a mode."""
    kind = mode.removeprefix("raw_")
    if kind == "chain":
        return [(0, 1)], [0], [1]
    if kind == "fanout":
        return [(0, 1), (0, 2)], [0], [1, 2]
    return [(0, 2), (1, 2)], [0, 1], [2]


def pipeline(mode: str, backend: str, config: dict[str, Any]) -> dict[str, Any]:
    """The pipeline (a dict) of a mode: every edge on one connector instance, streaming."""
    edges, producers, _ = graph(mode)
    stages = []
    for sid in sorted({s for e in edges for s in e}):
        stage: dict[str, Any] = {"stage_id": sid, "async_chunk": True, "recv_timeout_s": GRACE_S}
        if sid in producers:
            stage["custom_process_next_stage_input_func"] = BUILDER
            stage["output_connectors"] = {f"to_stage_{b}": "c" for a, b in edges if a == sid}
        else:
            stage["input_connectors"] = {f"from_stage_{a}": "c" for a, b in edges if b == sid}
        stages.append(stage)
    return {"connectors": {"c": {"name": backend, "extra": config}}, "stages": stages}


def produce_stage(
    mode: str,
    stage: int,
    pipeline_dict: dict[str, Any],
    traffic: Traffic,
    tag: str,
    *,
    start: Callable[[], float],
    release: Callable[[], Any],
) -> dict[str, Any]:
    """A producing stage of ``mode``: every stream's chunks, on the runtime or (``raw_*``) a put per destination."""
    import torch

    from omni_plugins import create_connector
    from omni_plugins.config import PipelineConfig
    from omni_plugins.runtime import StageTransferRuntime

    config = PipelineConfig.model_validate(pipeline_dict)
    topo = config.topology(stage)
    raw = mode.startswith("raw_")
    spec = config.connectors["c"]
    conn = create_connector(spec.name, spec.extra) if raw else None
    rt = None if raw else StageTransferRuntime.from_pipeline(config, stage)
    requests = [_Request(f"{tag}-{i}") for i in range(traffic.streams)]
    chunk = torch.ones(traffic.chunk_bytes // 4, dtype=torch.float32)
    grouped = 0
    try:
        _sleep_until(start())
        cpu0 = time.process_time()
        next_step = time.monotonic()
        for step in range(traffic.steps):
            due = next_step
            last = step == traffic.steps - 1
            for req in requests:
                req.done = last
                x = chunk.clone()
                t0 = due  # the step's outputs exist at its scheduled moment: lag behind it is part of the hand-off
                out: dict[str, Any] = {"chunk": {"data": x}, "ts": {"send": [t0]}}
                if rt is not None:
                    rt.send_chunk(req, out)
                    continue
                assert conn is not None
                out["meta"] = {"finished": last, "override_keys": ["chunk"]}
                targets = [(stage, edge.to_stage, f"{req.request_id}_{edge.key_stage}_{step}") for edge in topo.outputs]
                if len(targets) > 1:
                    conn.put_many(targets, out)
                    grouped += 1
                else:
                    conn.put(*targets[0], out)
            next_step += traffic.interval_s
            _sleep_until(next_step)
        if rt is not None:
            rt.wait_sends(GRACE_S)
            grouped = rt.debug_state()["sender"]["put_many"]
        cpu = time.process_time() - cpu0
        release()
        if rt is not None:
            for req in requests:
                rt.cleanup_finished_request(req.request_id)
    finally:
        if rt is not None:
            rt.shutdown()
        if conn is not None:
            conn.close()
    return {"cpu_s": cpu, "put_many": grouped}


def consume_stage(
    mode: str, stage: int, pipeline_dict: dict[str, Any], traffic: Traffic, tag: str, *, start: Callable[[], float]
) -> dict[str, Any]:
    """A consuming stage of ``mode``: every chunk of every source; latencies (s) and CPU."""
    from omni_plugins import create_connector
    from omni_plugins.config import PipelineConfig
    from omni_plugins.runtime import StageTransferRuntime

    config = PipelineConfig.model_validate(pipeline_dict)
    topo = config.topology(stage)
    sources = [e.from_stage for e in topo.inputs]
    ids = [f"{tag}-{i}" for i in range(traffic.streams)]
    want = len(ids) * traffic.steps * len(sources)
    lat: list[float] = []
    if mode.startswith("raw_"):
        spec = config.connectors["c"]
        conn = create_connector(spec.name, spec.extra)
        try:
            keys = {f"{rid}_{e.key_stage}_0": (rid, e, 0) for rid in ids for e in topo.inputs}
            deadline = start() + traffic.steps * traffic.interval_s + GRACE_S
            cpu0 = time.process_time()
            while keys and time.monotonic() < deadline:
                for key in conn.wait_any(list(keys), 0.05):
                    got = conn.get(0, stage, key, timeout=None)
                    now = time.monotonic()
                    if got is None:
                        continue
                    rid, e, k = keys.pop(key)
                    lat.append(now - got.data["ts"]["send"][0])
                    if k + 1 < traffic.steps:
                        keys[f"{rid}_{e.key_stage}_{k + 1}"] = (rid, e, k + 1)
            cpu = time.process_time() - cpu0
        finally:
            conn.close()
        return {"latencies": lat, "cpu_s": cpu, "missing": want - len(lat)}
    rt = StageTransferRuntime.from_pipeline(config, stage)
    fan_in = len(sources) > 1
    seen: dict[tuple[str, int], int] = {}

    def took(rid: str, src: int, payload: Any, now: float) -> None:
        sends = payload["ts"]["send"]
        lat.extend(now - t0 for t0 in sends[seen.get((rid, src), 0) :])
        seen[(rid, src)] = len(sends)

    try:
        for rid in ids:
            rt.register_chunk_recv(_Request(rid))
        finished: set[str] = set()
        deadline = start() + traffic.steps * traffic.interval_s + GRACE_S
        cpu0 = time.process_time()
        while len(finished) < len(ids) and time.monotonic() < deadline:
            rt.wait_ready(0.05)
            ready = rt.recv_chunk()
            now = time.monotonic()
            for rid, payload in ready.items():
                for src, part in payload.items() if fan_in else [(sources[0], payload)]:
                    took(rid, src, part, now)
            signals = rt.collect_signals()
            # a chunk that landed between recv_chunk and collect_signals (also of a request or source
            # recv_chunk returned) is in the signals and the cache, and will not be returned again
            late = (
                {rid: set(srcs) for rid, srcs in signals.chunk_ready_sources.items()}
                if fan_in
                else {rid: {sources[0]} for rid in signals.chunk_ready}
            )
            if late:
                now = time.monotonic()
                for rid, srcs in late.items():
                    cached = rt.get_local_stage_payload(rid)
                    for src, part in cached.items() if fan_in else [(sources[0], cached)]:
                        if src in srcs:
                            took(rid, src, part, now)
            finished |= signals.chunk_finished
        cpu = time.process_time() - cpu0
        for rid in ids:
            rt.cleanup_finished_request(rid)
    finally:
        rt.shutdown()
    return {"latencies": lat, "cpu_s": cpu, "missing": want - len(lat)}


TOPOLOGY_COLUMNS = [
    Column(key="mode", label="mode", kind="text"),
    Column(key="p50_ms", label="p50 ms", digits=3),
    Column(key="p99_ms", label="p99 ms", digits=3),
    Column(key="cpu_us_per_chunk", label="CPU us per delivered chunk", digits=1),
    Column(key="p50_vs_chain", label="p50 / chain"),
    Column(key="cpu_vs_chain", label="CPU / chain"),
    Column(key="p50_vs_connector", label="p50 / connector alone"),
    Column(key="put_many", label="put_many calls", digits=0),
    Column(key="missing", label="missing", digits=0),
]


def traffic_for(opts: BenchOptions) -> Traffic:
    """Light traffic (nothing queues): the load section's streams, 4 KiB chunks every 20 ms."""
    lo = opts.load
    steps = 4 if opts.quick else 12
    return Traffic(lo.streams if lo is not None else 64, 4096, 0.02, steps, steps)


def run_topology(opts: BenchOptions, doc: BenchDocument, bar: Any) -> None:
    from omni_plugins.bench.load import in_flight_bytes
    from omni_plugins.bench.runner import Skip, prepared_backend
    from omni_plugins.bench.traffic import StageProcesses

    backend = opts.runtime_backend
    assert backend is not None
    traffic = traffic_for(opts)
    rounds = opts.load.rounds if opts.load is not None else 3
    section = doc.sections.setdefault(
        "topology",
        Section(
            title="Fan-out and fan-in against a chain",
            about=__doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
            columns=TOPOLOGY_COLUMNS,
        ),
    )
    section.setup.update({"backend": backend, "traffic": traffic.label(), "chunks_per_stream": traffic.steps, "rounds": rounds})
    runs: dict[str, list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]] = {m: [] for m in MODES}
    bar.total += len(MODES) * rounds
    try:
        with prepared_backend(backend, opts.configs, in_flight_bytes(traffic.streams, traffic.chunk_bytes)) as prepared:
            pool = StageProcesses(3)
            try:
                plan = [(-1, "chain"), (-1, "fanin")] + [(r, m) for r in range(rounds) for m in (MODES if r % 2 == 0 else MODES[::-1])]
                for rnd, mode in plan:  # round -1 warms every process up (imports, mappings), unrecorded
                    bar.set_postfix_str(f"topology: {mode}")
                    tag = f"tp{uuid.uuid4().hex[:8]}"
                    spec = pipeline(mode, backend, prepared.config)
                    _, producers, consumers = graph(mode)
                    jobs = [("produce", f"{__name__}:produce_stage", (mode, s, spec, traffic, tag)) for s in producers]
                    jobs += [("consume", f"{__name__}:consume_stage", (mode, s, spec, traffic, tag)) for s in consumers]
                    out = pool.run(jobs, traffic.steps * traffic.interval_s + GRACE_S + 60)
                    if rnd >= 0:
                        runs[mode].append((out[: len(producers)], out[len(producers) :]))
                        bar.update(1)
            finally:
                pool.close()
    except Skip as exc:
        doc.skipped[f"topology: {backend}"] = str(exc)
        return
    section.rows += topology_rows(runs)
    doc.targets += topology_targets(section.rows)


def topology_rows(runs: dict[str, list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]]) -> list[dict[str, Value]]:
    rows: dict[str, dict[str, Value]] = {}
    for mode, got in runs.items():
        lat = sorted(x for _, consumers in got for c in consumers for x in c["latencies"])
        delivered = max(1, len(lat))
        cpu = sum(p["cpu_s"] for producers, consumers in got for p in [*producers, *consumers])
        rows[mode] = {
            "mode": mode,
            "p50_ms": percentile(lat, 0.5) * 1e3 if lat else None,
            "p99_ms": percentile(lat, 0.99) * 1e3 if lat else None,
            "cpu_us_per_chunk": cpu / delivered * 1e6,
            "delivered": len(lat),
            "put_many": sum(p.get("put_many", 0) for producers, _ in got for p in producers),
            "missing": sum(c["missing"] for _, consumers in got for c in consumers),
        }
    for mode in ("chain", "fanout", "fanin"):
        row, chain, raw = rows[mode], rows["chain"], rows[f"raw_{mode}"]
        row["p50_vs_chain"] = _ratio(row["p50_ms"], chain["p50_ms"])
        row["cpu_vs_chain"] = _ratio(row["cpu_us_per_chunk"], chain["cpu_us_per_chunk"])
        row["p50_vs_connector"] = _ratio(row["p50_ms"], raw["p50_ms"])
    return list(rows.values())


def _ratio(a: Value, b: Value) -> float | None:
    x, y = number(a), number(b)
    return x / y if x is not None and y else None


def topology_targets(rows: list[dict[str, Value]]) -> list[TargetResult]:
    """The per-chunk cost of a fan-out and a fan-in within 1.3x of a chain's.

    Their hand-off p50 against the chain's is reported beside it (``p50 / chain``), not held to a
    bound: a fan-out makes and delivers twice the chunks of a chain on the same cores, so its
    latency carries that load; the cost of each chunk is what the topology itself adds.
    """
    by_mode = {str(r["mode"]): r for r in rows}
    values = [(m, v) for m in ("fanout", "fanin") if (v := number(by_mode[m].get("cpu_vs_chain"))) is not None]
    return [
        check(
            section="topology",
            subject="runtime",
            description="fan-out and fan-in CPU per delivered chunk within 1.3x of a chain's",
            op="<=",
            bound=1.3,
            values=values,
        )
    ]
