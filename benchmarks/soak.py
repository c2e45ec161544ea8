"""Soak: many streamed requests, some aborted midway, through the runtime across two processes.

Stage 0 (the producer, a child process) streams every request as ``--chunks``
chunks through ``StageTransferRuntime.send_chunk``; stage 1 (this process)
receives them with the ``"ar"`` worker rules and verifies every merged stream row
by row. ``--abort-fraction`` of the requests are aborted after half their chunks on
both stages (producer first, then consumer: ``cleanup_finished_request(aborted=True)``).
Requests run in windows of ``--window`` concurrent streams; every 25th request
carries large chunks (256 KiB: Redis parts, dedicated-size pool segments).

Afterwards it checks what must be zero -- per-request runtime state on both
stages, published/claimed shared-memory segments (before close) and every file
of the namespace (after close), Redis keys under the prefix (before and after
close), objects on the soak's own ``mooncake_master`` (before and after close)
-- and how resident memory moved: the mean RSS of each process over the first
thousand requests against the last thousand (``rss_growth``). The leak
checks are the result; there is no baseline to take a ratio against except the
process's own first thousand requests.

    python benchmarks/soak.py [--requests 10000] [--backends shm,redis,mooncake-store] [--json FILE] [--quick]

``tests/reliability/test_soak_bounded.py`` runs :func:`run_soak` with a few hundred requests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omni_plugins.bench.runner import report, script_document
from omni_plugins.bench.schema import Column, Section

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

from rel_pipeline import Plan, StageProcess, StreamConsumer, make_runtime, rss_bytes

BIG_EVERY = 25
BIG_ELEMS = 64 * 1024  # 256 KiB of float32 per chunk


@dataclass
class SoakResult:
    backend: str
    requests: int
    aborted: int
    finished: int
    bad: dict[str, Any] = field(default_factory=dict)  # request id -> what went wrong
    consumer_active: int = -1
    producer_active: int = -1
    leftovers_open: list[str] = field(default_factory=list)  # payload segments / keys before close
    leftovers_closed: list[str] = field(default_factory=list)  # anything of the namespace / prefix after close
    seconds: float = 0.0
    rss: dict[str, Any] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return (
            not self.bad
            and self.consumer_active == 0
            and self.producer_active == 0
            and not self.leftovers_open
            and not self.leftovers_closed
            and self.finished + self.aborted == self.requests
        )

    def to_json(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["clean"] = self.clean
        out["bad"] = dict(list(self.bad.items())[:20])
        out["leftovers_open"] = self.leftovers_open[:20]
        out["leftovers_closed"] = self.leftovers_closed[:20]
        out["requests_per_s"] = round(self.requests / self.seconds, 1) if self.seconds else None
        return out


# ---------------------------------------------------------------------------------------------- backends
class ShmBackend:
    name = "shm"

    def __init__(self) -> None:
        from omni_plugins_shm.testing import unique_namespace

        self.namespace = unique_namespace("soak")

    @contextlib.contextmanager
    def running(self) -> Iterator[dict[str, Any]]:
        yield {"name": "shm", "extra": {"namespace": self.namespace, "pool_bytes": 64 << 20}}

    def payload_leftovers(self) -> list[str]:
        """Published (k./h.) or claimed (c.) segments: payloads nobody freed. Pool (f.) and markers (o.) are allowed while open."""
        from omni_plugins_shm.testing import namespace_segments

        return [n for n in namespace_segments(self.namespace) if n.split(".")[2] in ("k", "h", "c", "w")]

    def all_leftovers(self) -> list[str]:
        from omni_plugins_shm.testing import namespace_segments

        return namespace_segments(self.namespace)


class RedisBackend:
    name = "redis"

    def __init__(self, server: Any = None) -> None:
        self.prefix = f"soak-{uuid.uuid4().hex[:8]}:"
        self._server = server
        self._own = server is None

    @contextlib.contextmanager
    def running(self) -> Iterator[dict[str, Any]]:
        from omni_plugins_redis.testing import RedisServer

        server = self._server or RedisServer().start()
        self._server = server
        try:
            yield {"name": "redis", "extra": server.connector_config(key_prefix=self.prefix)}
        finally:
            self._closed_keys = [k.decode(errors="replace") for k in server.keys(self.prefix + "*")]
            if self._own:
                server.stop()

    def payload_leftovers(self) -> list[str]:
        """Manifests, parts and claim lists. Commit markers (``:w:``) are not payloads: their delete rides
        on the connection's next write, so the last put's marker may wait for close (checked then)."""
        assert self._server is not None
        return [k.decode(errors="replace") for k in self._server.keys(self.prefix + "*") if b":w:" not in k]

    def all_leftovers(self) -> list[str]:
        return self._closed_keys


class MooncakeStoreBackend:
    """A private ``mooncake_master`` on loopback; leftovers are the objects it still holds (its key-count metric)."""

    name = "mooncake-store"
    #: consumed objects are removed by each connector's background remover: how long they may take
    SETTLE_S = 10.0

    def __init__(self) -> None:
        self.master: Any = None
        self._closed_leftovers: list[str] = []

    @contextlib.contextmanager
    def running(self) -> Iterator[dict[str, Any]]:
        from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment

        loopback_environment()  # engines of this process and the producer child bind loopback
        master = MooncakeMaster().start()
        self.master = master
        try:
            yield {
                "name": "mooncake-store",
                "extra": {"master_address": master.address, "global_segment_size": "256MiB", "local_buffer_size": "32MiB"},
            }
        finally:
            self._closed_leftovers = self._objects()
            master.stop()

    def _objects(self) -> list[str]:
        """``[]`` once the master holds no object (waiting up to ``SETTLE_S``), else one line saying how many."""
        count = self.master.settled_key_count(self.SETTLE_S)
        return [f"{count} objects on the master"] if count else []

    def payload_leftovers(self) -> list[str]:
        return self._objects()

    def all_leftovers(self) -> list[str]:
        return self._closed_leftovers


SoakBackend = ShmBackend | RedisBackend | MooncakeStoreBackend


def make_backend(name: str, **kw: Any) -> SoakBackend:
    if name == "shm":
        return ShmBackend()
    if name == "redis":
        return RedisBackend(**kw)
    if name == "mooncake-store":
        return MooncakeStoreBackend()
    raise SystemExit(f"unknown backend {name!r} (shm, redis, mooncake-store)")


# ---------------------------------------------------------------------------------------------- the run
def plans_for(start: int, count: int, *, abort_fraction: float, chunks: int, tag: str) -> list[Plan]:
    """Requests ``start..start+count``; every ``1/abort_fraction``-th is aborted after half its chunks."""
    every = round(1 / abort_fraction) if abort_fraction > 0 else 0
    out = []
    for i in range(start, start + count):
        aborted = every > 0 and i % every == every // 2
        out.append(Plan(f"{tag}-{i}", chunks=chunks, elems=BIG_ELEMS if i % BIG_EVERY == 7 else 256 + (i % 7) * 128,
                        abort_after=max(1, chunks // 2) if aborted else None))  # fmt: skip
    return out


def run_soak(
    backend: SoakBackend,
    *,
    requests: int,
    abort_fraction: float = 0.1,
    chunks: int = 4,
    window: int = 50,
    window_timeout: float = 120.0,
    progress: bool = False,
) -> SoakResult:
    """Run ``requests`` through a producer process and this process's consumer; every wait is bounded."""
    result = SoakResult(backend.name, requests, 0, 0)
    rss_samples: list[tuple[int, int, int]] = []  # (requests done, consumer rss, producer rss)
    tag = uuid.uuid4().hex[:6]
    started = time.perf_counter()
    with backend.running() as conn:
        consumer_rt = make_runtime(1, conn, recv_timeout_s=window_timeout)
        producer: StageProcess | None = None
        try:
            producer = StageProcess({"stage_id": 0, "connector": conn})
            consumer = StreamConsumer(consumer_rt)
            bar = tqdm(total=requests, desc=f"soak {backend.name}", unit="req", disable=not progress)
            done = 0
            while done < requests:
                plans = plans_for(done, min(window, requests - done), abort_fraction=abort_fraction, chunks=chunks, tag=tag)
                consumer.register([p.id for p in plans], chunks={p.id: p.chunks for p in plans})
                produced = producer.call("produce", "produced", timeout=window_timeout, plans=[p.to_json() for p in plans])
                for rid in produced["failed"]:
                    result.bad[rid] = "producer reported the send failed"
                live = [p.id for p in plans if not p.aborted]
                consumer.run_until(lambda c, ids=live: c.settled(ids), window_timeout)  # type: ignore[misc]
                for p in plans:
                    out = consumer.outcomes[p.id]
                    if p.aborted:
                        result.aborted += 1
                    elif out.status == "finished" and out.error is None:
                        result.finished += 1
                    else:
                        result.bad[p.id] = {"status": out.status, "error": out.error, "rows": out.rows}
                aborted = [p.id for p in plans if p.aborted]
                consumer.abort(aborted)
                consumer.forget(live)
                for rid in live:  # a request that never settled must not keep state around either
                    consumer_rt.cleanup_finished_request(rid)
                done += len(plans)
                bar.update(len(plans))
                rss_samples.append((done, rss_bytes(), rss_bytes(producer.pid)))
            bar.close()
            result.consumer_active = consumer_rt.active_request_count()
            result.producer_active = int(producer.call("state", "state")["active"])
            result.leftovers_open = backend.payload_leftovers()
        finally:
            if producer is not None:
                producer.close()
            consumer_rt.shutdown()
    result.seconds = time.perf_counter() - started
    result.leftovers_closed = backend.all_leftovers()
    result.rss = rss_summary(rss_samples, requests)
    return result


def rss_summary(samples: list[tuple[int, int, int]], requests: int) -> dict[str, Any]:
    """Mean RSS over the first, the middle and the last thousand requests, per process, and the growth.

    ``growth`` is last against first: it includes the warm-up (pools, buffers touched
    page by page). ``growth_second_half`` is last against the thousand from the halfway
    point on: a leak keeps growing there, a warm-up does not.
    """
    if not samples:
        return {}
    span = min(1000, max(requests // 4, 1))
    half = requests // 2
    first = [s for s in samples if s[0] <= span] or samples[:1]
    middle = [s for s in samples if half < s[0] <= half + span] or samples[len(samples) // 2 : len(samples) // 2 + 1]
    last = [s for s in samples if s[0] > requests - span] or samples[-1:]
    out: dict[str, Any] = {"span_requests": span, "samples": [list(s) for s in samples]}
    for i, who in ((1, "consumer"), (2, "producer")):
        a = statistics.fmean(s[i] for s in first)
        m = statistics.fmean(s[i] for s in middle)
        b = statistics.fmean(s[i] for s in last)
        out[who] = {
            "first_mib": round(a / 2**20, 1),
            "middle_mib": round(m / 2**20, 1),
            "last_mib": round(b / 2**20, 1),
            "growth": round(b / a - 1, 4),
            "growth_second_half": round(b / m - 1, 4),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--backends", default="shm,redis")
    ap.add_argument("--quick", action="store_true", help="1000 requests")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    requests = 1000 if args.quick else args.requests
    doc = script_document(args.quick)
    rows: list[dict[str, Any]] = []
    ok = True
    for name in args.backends.split(","):
        res = run_soak(
            make_backend(name.strip()), requests=requests, abort_fraction=args.abort_fraction, chunks=args.chunks, window=args.window,
            progress=True,
        )  # fmt: skip
        ok &= res.clean
        growth = {k: (v["growth"], v["growth_second_half"]) for k, v in res.rss.items() if isinstance(v, dict)}
        print(
            f"{res.backend}: {res.finished} finished, {res.aborted} aborted, {len(res.bad)} bad, state {res.consumer_active}/"
            f"{res.producer_active}, leftovers {len(res.leftovers_open)}/{len(res.leftovers_closed)}, rss growth (all, second half) {growth}, "
            f"{res.seconds:.0f} s",
            file=sys.stderr,
        )
        row = {k: v for k, v in res.to_json().items() if isinstance(v, (int, float, str, bool)) or v is None}
        row["bad"] = len(res.bad)
        row["leftovers_open"] = len(res.leftovers_open)
        row["leftovers_closed"] = len(res.leftovers_closed)
        for proc, v in res.rss.items():
            if isinstance(v, dict):
                row[f"{proc}_rss_growth"] = v["growth"]
                row[f"{proc}_rss_growth_second_half"] = v["growth_second_half"]
        rows.append(row)
    doc.sections["soak"] = Section(
        title="Soak: streamed requests with aborts",
        about=__doc__.split("\n\n")[0].replace("\n", " "),
        columns=[
            Column(key="backend", label="backend", kind="text"),
            Column(key="requests", label="requests", digits=0),
            Column(key="finished", label="finished", digits=0),
            Column(key="aborted", label="aborted", digits=0),
            Column(key="bad", label="bad", digits=0),
            Column(key="leftovers_open", label="left (open)", digits=0),
            Column(key="leftovers_closed", label="left (closed)", digits=0),
            Column(key="requests_per_s", label="requests/s", digits=1),
            Column(key="clean", label="clean", kind="text"),
        ],
        rows=rows,
        setup={"abort_fraction": args.abort_fraction, "chunks_per_request": args.chunks, "window": args.window},
    )
    doc.machine.load_avg_end = [round(x, 2) for x in os.getloadavg()]
    print(report(doc))
    if args.json:
        doc.write(args.json)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
