"""The peer in the same run: vLLM-Omni's own connector and its own runtime, next to ours.

Runs where vLLM-Omni is installed (its integration venv: ``bash scripts/setup.sh vllm-omni``,
then ``.venv-vllm/bin/omni-plugins bench --sections peer``). Two measurements:

- **sizes**: the runtime backend's raw baseline, its connector and vLLM-Omni's own connector of
  the same kind (the vLLM-Omni name the backend answers to as an alias, e.g.
  ``SharedMemoryConnector`` for ``shm``), called directly (``put`` / ``get`` with put's
  metadata handed along, as its orchestrator does), as three lanes of the size curve in the same
  processes, interleaved; ``vs_peer`` = vLLM-Omni's time / ours.
- **runtime**: the same streams (:mod:`.traffic`) through our runtime over our connector and through
  vLLM-Omni's model-runner runtime (``OmniConnectorModelRunnerMixin``: ``send_chunk`` on the
  producer, its receive thread, readiness through its same-process output sink, the payload read
  from its local cache) over its own connector, each stage in its own process.

vLLM-Omni is imported only inside these functions: the core imports nothing of it.
"""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.schema import Column, Section, TargetResult, Value
from omni_plugins.bench.targets import check, number
from omni_plugins.bench.traffic import BUILDER, GRACE_S, Traffic, _Request, _sleep_until, emissions, median

if TYPE_CHECKING:
    import torch

    from omni_plugins.bench.runner import BenchOptions
    from omni_plugins.bench.schema import BenchDocument

#: how to get the peer's venv
INSTALL = "bash scripts/setup.sh vllm-omni, then run .venv-vllm/bin/omni-plugins bench --sections peer"


def missing_peer() -> str | None:
    """None when vLLM-Omni can be imported here, else how to run the peer section."""
    if importlib.util.find_spec("vllm_omni") is None:
        return f"the peer section needs vLLM-Omni, which this environment lacks: {INSTALL}"
    return None


def peer_name(backend: str) -> str:
    """vLLM-Omni's connector of the same kind as ``backend``: the alias of ours its factory knows."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    from omni_plugins.factory import resolve_connector

    spec = resolve_connector(backend)
    known = set(OmniConnectorFactory.list_registered_connectors())
    for alias in spec.aliases:
        if alias in known:
            return str(alias)
    raise LookupError(f"connector {backend!r} answers to no vLLM-Omni connector name (its aliases: {', '.join(spec.aliases) or 'none'})")


def _peer_connector(name: str, stage: int) -> Any:
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec

    return OmniConnectorFactory.create_connector(ConnectorSpec(name=name, extra={"stage_id": stage}))


class PeerLane:
    """vLLM-Omni's connector as a lane of the size curve: ``put`` returns its metadata, ``get`` receives it."""

    def __init__(self, name: str, producer: bool) -> None:
        self._connector = _peer_connector(name, 0 if producer else 1)
        self._producer = producer
        #: segment names are the keys themselves, in /dev/shm: the producer picks a prefix private to this run
        self._prefix = f"omnibench{uuid.uuid4().hex[:8]}-" if producer else ""

    def handshake(self) -> Mapping[str, Any]:
        return {"prefix": self._prefix} if self._producer else {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        if not self._producer:
            self._prefix = str(peer["prefix"])

    def put(self, key: str, payload: torch.Tensor) -> Any:
        ok, _, metadata = self._connector.put("0", "1", put_key=self._prefix + key, data={"t": payload})
        if not ok:
            raise RuntimeError(f"vLLM-Omni put of {key} failed")
        return metadata

    def get(self, key: str, nbytes: int, token: Any) -> Any:
        deadline = time.monotonic() + GRACE_S
        while True:
            got = self._connector.get("0", "1", get_key=self._prefix + key, metadata=token)
            if got is not None:
                return got[0]["t"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM-Omni get of {key} found nothing")
            time.sleep(0.0002)

    def close(self) -> None:
        self._connector.close()


# -- vLLM-Omni's runtime on one stage ------------------------------------------------------------
def _peer_runtime(name: str, stage: int) -> Any:
    """A minimal model runner with vLLM-Omni's connector mixin, initialised as a streaming stage."""
    from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin

    class Runner(OmniConnectorModelRunnerMixin):  # the attributes a vLLM model runner has and the mixin reads
        def __init__(self) -> None:
            self.vllm_config = None
            self.requests: dict[str, Any] = {}
            self.model_intermediate_buffer: dict[str, Any] = {}

    config = SimpleNamespace(
        stage_id=stage,
        async_chunk=True,
        worker_type="ar",
        model_stage=None,
        custom_process_next_stage_input_func=BUILDER if stage == 0 else None,
        custom_process_input_func=None,
        stage_connector_config={"name": name, "extra": {"stage_id": stage}},
        requires_full_payload_input=False,
    )
    runner = Runner()
    runner.init_omni_connectors(config)
    return runner


def produce_peer(backend: str, traffic: Traffic, tag: str, start: Callable[[], float], release: Callable[[], Any]) -> dict[str, Any]:
    """The producing stage on vLLM-Omni's runtime: ``send_chunk`` per chunk, as :func:`traffic.produce` does on ours."""
    import torch

    runner = _peer_runtime(peer_name(backend), 0)
    chunk = torch.ones(traffic.chunk_bytes // 4, dtype=torch.float32)
    finished: list[str] = []
    try:
        _sleep_until(start())
        cpu0, wall0 = time.process_time(), time.monotonic()
        for chunk_out in emissions(traffic, tag, chunk, wall0):
            runner.send_chunk(chunk_out.request, chunk_out.payload)
            if chunk_out.last:
                finished.append(chunk_out.request.request_id)
        _wait_sends(runner, GRACE_S)
        sent_s = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        release()
        for rid in finished:
            runner.cleanup_finished_request(rid)
    finally:
        runner.shutdown_omni_connectors()
    return {"sent_s": sent_s, "cpu_s": cpu}


def _wait_sends(runner: Any, timeout: float) -> None:
    """Until vLLM-Omni's save thread has put every queued chunk."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with runner._lock:
            if not any(runner._pending_save_reqs.values()) and not any(runner._pending_save_counts.values()):
                return
        time.sleep(0.001)


def consume_peer(backend: str, traffic: Traffic, tag: str, start: Callable[[], float]) -> dict[str, Any]:
    """The consuming stage on vLLM-Omni's runtime: woken through its output sink, the payload read from its cache."""
    runner = _peer_runtime(peer_name(backend), 1)
    news: list[Any] = []
    woken = threading.Event()
    guard = threading.Lock()

    def sink(output: Any) -> None:
        with guard:
            news.append(output)
        woken.set()

    runner.set_omni_connector_output_sink(sink)
    requests_per_stream = traffic.chunks_per_stream // traffic.per_request
    lat: list[float] = []
    seen: dict[str, int] = {}
    slot_of: dict[str, tuple[int, int]] = {}
    ahead: set[str] = set()

    def register(stream: int, r: int) -> None:
        if r < requests_per_stream:
            rid = traffic.request_id(tag, stream, r * traffic.per_request)
            slot_of[rid] = (stream, r)
            runner.register_chunk_recv(_Request(rid))

    finished = 0
    try:
        for i in range(traffic.streams):
            register(i, 0)
        start_at = last_at = start()
        deadline = start_at + traffic.steps * traffic.interval_s + GRACE_S
        cpu0 = time.process_time()
        want = traffic.streams * requests_per_stream
        while finished < want and time.monotonic() < deadline:
            woken.wait(0.05)
            woken.clear()
            with guard:
                outputs, news[:] = list(news), []
            outputs.append(runner.get_omni_connector_output())  # anything published without the sink
            now = time.monotonic()
            for output in outputs:
                for rid in output.chunk_ready_req_ids or ():
                    payload = runner.get_local_stage_payload(rid)
                    if payload is None:
                        continue
                    sends = payload["ts"]["send"]
                    lat.extend(now - t0 for t0 in sends[seen.get(rid, 0) :])
                    seen[rid] = len(sends)
                    last_at = now
                    if rid not in ahead:
                        ahead.add(rid)
                        stream, r = slot_of[rid]
                        register(stream, r + 1)
                for rid in output.chunk_finished_req_ids or ():
                    runner.cleanup_finished_request(rid)
                    finished += 1
        cpu = time.process_time() - cpu0
    finally:
        runner.shutdown_omni_connectors()
    return {"latencies": lat, "start_at": start_at, "last_at": last_at, "cpu_s": cpu, "missing": traffic.chunks - len(lat), "leftover": 0}


# -- the section ---------------------------------------------------------------------------------
PEER_COLUMNS = [
    Column(key="what", label="measure", kind="text"),
    Column(key="size", label="size", kind="size"),
    Column(key="point", label="traffic", kind="text"),
    Column(key="ours_us", label="ours us", digits=1),
    Column(key="peer_us", label="vLLM-Omni us", digits=1),
    Column(key="raw_us", label="raw us", digits=1),
    Column(key="ours_p50_ms", label="ours p50 ms", digits=3),
    Column(key="peer_p50_ms", label="vLLM-Omni p50 ms", digits=3),
    Column(key="ours_p99_ms", label="ours p99 ms", digits=3),
    Column(key="peer_p99_ms", label="vLLM-Omni p99 ms", digits=3),
    Column(key="vs_peer", label="vLLM-Omni / ours"),
]


def run_peer(opts: BenchOptions, doc: BenchDocument, bar: Any) -> None:
    from omni_plugins.bench import sizes
    from omni_plugins.bench.lanes import LaneSpec
    from omni_plugins.bench.load import in_flight_bytes, warm_up
    from omni_plugins.bench.runner import Skip, prepared_backend
    from omni_plugins.bench.traffic import StagePair

    backend = opts.runtime_backend
    lo = opts.load
    assert backend is not None and lo is not None
    name = peer_name(backend)
    section = doc.sections.setdefault(
        "peer",
        Section(
            title=f"vLLM-Omni in the same run ({name} next to {backend})",
            about=(
                f"sizes: put + get of {backend}'s raw baseline, the {backend} connector and vLLM-Omni's own {name} called directly "
                "(its put's metadata handed to its get), producer and consumer in separate processes, interleaved; vs_peer = "
                f"vLLM-Omni's time / ours. runtime: the same streams through our runtime over {backend} and through vLLM-Omni's "
                f"model-runner runtime (OmniConnectorModelRunnerMixin) over {name}, each stage its own process; hand-off p50 and "
                "p99 from the chunk made to the consumer's model thread holding it; vs_peer = vLLM-Omni's p50 / ours."
            ),
            columns=PEER_COLUMNS,
        ),
    )
    section.setup.update({"backend": backend, "peer": name})
    max_bytes = max(opts.sizes)
    try:
        with prepared_backend(backend, opts.configs, max_bytes) as prepared:
            lanes = [
                LaneSpec("raw", "raw", backend, prepared.config, max_bytes),
                LaneSpec("connector", "connector", backend, prepared.config, max_bytes),
                LaneSpec("peer", "peer", backend, prepared.config, max_bytes),
            ]
            bar.total += sizes.planned_ops(len(lanes), 0, opts.sizes, opts.quick)
            rows = sizes.measure_lanes(lanes, opts.sizes, opts.quick, tick=bar.update, round_trips=False)
        for size, medians, _ in rows:
            mine, peer, raw = medians["connector"]["transfer"], medians["peer"]["transfer"], medians["raw"]["transfer"]
            section.rows.append(
                {"what": "put + get", "size": size, "ours_us": mine, "peer_us": peer, "raw_us": raw, "vs_peer": peer / mine}
            )
        points = [lo.traffic(i) for i in sorted(lo.intervals_s, reverse=True)[:2]]
        with prepared_backend(backend, opts.configs, in_flight_bytes(lo.streams, lo.chunk_bytes)) as prepared:
            pair = StagePair()
            got: dict[tuple[int, str], list[dict[str, float]]] = {(p, m): [] for p in range(len(points)) for m in ("runtime", "peer")}
            bar.total += len(points) * 2 * lo.rounds
            try:
                warm_up(pair, backend, prepared.config, points[0], modes=("runtime", "peer"))
                for rnd in range(lo.rounds):
                    for p, traffic in enumerate(points):
                        for mode in ("runtime", "peer") if rnd % 2 == 0 else ("peer", "runtime"):
                            got[(p, mode)].append(pair.run_traffic(mode, backend, prepared.config, traffic, f"pr{uuid.uuid4().hex[:8]}"))
                            bar.update(1)
            finally:
                pair.close()
    except Skip as exc:
        doc.skipped[f"peer: {backend}"] = str(exc)
        return
    for p, traffic in enumerate(points):
        ours = {k: median([r[k] for r in got[(p, "runtime")]]) for k in ("p50_ms", "p99_ms")}
        theirs = {k: median([r[k] for r in got[(p, "peer")]]) for k in ("p50_ms", "p99_ms")}
        section.rows.append(
            {
                "what": "runtime hand-off",
                "point": traffic.label(),
                "ours_p50_ms": ours["p50_ms"],
                "peer_p50_ms": theirs["p50_ms"],
                "ours_p99_ms": ours["p99_ms"],
                "peer_p99_ms": theirs["p99_ms"],
                "vs_peer": theirs["p50_ms"] / ours["p50_ms"] if ours["p50_ms"] else None,
                "missing": sum(r["missing"] for m in ("runtime", "peer") for r in got[(p, m)]),
            }
        )
    doc.targets += peer_targets(section.rows)


def peer_targets(rows: list[dict[str, Value]]) -> list[TargetResult]:
    runtime = [r for r in rows if r.get("what") == "runtime hand-off"]
    out = []
    for q in ("p50", "p99"):
        values = [
            (str(r["point"]), a / b)
            for r in runtime
            if (a := number(r.get(f"ours_{q}_ms"))) is not None and (b := number(r.get(f"peer_{q}_ms")))
        ]
        out.append(
            check(
                section="peer",
                subject="runtime",
                description=f"runtime hand-off {q} <= 0.5x vLLM-Omni's own runtime on the same streams",
                op="<=",
                bound=0.5,
                values=values,
                note="ours / vLLM-Omni's",
            )
        )
    return out
