"""Streams of chunks between two stage processes: the runtime, or the connector alone, under the same traffic.

The traffic is ``streams`` concurrent requests; each emits a chunk of ``chunk_bytes`` every
``interval_s`` (every stream in the same model step: a burst per step, the hard case for one
receive thread), and after ``per_request`` chunks it finishes and the next request takes its
place. With ``per_step`` set, only that many streams emit in each step, a window rotating
through them (requests at different positions of their output, as in a server whose requests
started at different times): the steps, their size and the chunk rate then stay the same
whatever the number of streams. A chunk's clock starts at its step's scheduled moment (the model's outputs for every
stream exist then) and stops when the consumer's model thread holds it: a producer that falls
behind its schedule -- its earlier ``send_chunk`` or ``put`` calls took long, or the runtime made it
wait -- delays its chunks, and that delay is part of their hand-off. (Timing from the call
instead would hide an overload wherever the producer is held back rather than queued.)

- ``runtime``: :class:`~omni_plugins.runtime.StageTransferRuntime` on both sides; the producer's
  model thread calls ``send_chunk``, the consumer's ``wait_ready`` / ``recv_chunk`` /
  ``collect_signals`` and registers each request one request ahead of its chunks.
- ``connector``: no runtime. The producer's model thread ``put``\\ s each chunk as soon as it is
  made; one consumer thread waits on every stream's next key at once (``wait_any``) and ``get``\\ s
  each reported key: what a runtime that cost nothing would still see.
- ``floor``: the ``connector`` mode with one thread hand-off per chunk on each side
  (:mod:`~omni_plugins.bench.handoff`): what a runtime that keeps I/O off the model thread cannot
  avoid in CPython, whatever else it does.

Each chunk replaces the previous one of its request (``meta.override_keys``), as a stage that
consumes chunk by chunk reads them; the send times accumulate, so a read that merged several
chunks counts each. Used by the load and scaling sections, each side in its own process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: ``runtime`` (``runtime:<name>``: with a tuning overlay), ``connector`` (alone), ``floor`` (the connector
#: with a thread hand-off per side, :mod:`.handoff`), ``peer``: vLLM-Omni's runtime over its own connector
#: (:mod:`.peer`, in its integration venv)
Mode = str
#: the payload builder of the producing stage (a dotted path, as in a pipeline file)
BUILDER = "omni_plugins.bench.traffic.passthrough"
#: a consumer gives up this long after the traffic should have ended
GRACE_S = 120.0


def passthrough(transfer_manager: Any, pooling_output: Any, request: Any, is_finished: bool = False) -> Any:
    """Payload builder: the output is the chunk, which replaces the request's previous chunk."""
    out = dict(pooling_output)
    out["meta"] = {"finished": is_finished, "override_keys": ["chunk"]}
    return out


@dataclass(frozen=True)
class Traffic:
    """One load point: how many streams, how big and how often, for how many steps.

    ``per_step``: streams that emit in each step (0: every stream); ``steps`` x ``per_step``
    must be a multiple of ``streams`` x ``per_request``, so every request ends.
    """

    streams: int
    chunk_bytes: int
    interval_s: float
    steps: int
    per_request: int
    per_step: int = 0

    def __post_init__(self) -> None:
        if self.chunks % (self.streams * self.per_request):
            raise ValueError(f"{self.steps} steps of {self.emitting} chunks do not end every stream's requests")

    @property
    def emitting(self) -> int:
        """Streams that emit a chunk in each step."""
        return self.per_step or self.streams

    @property
    def offered_gbps(self) -> float:
        return self.emitting * self.chunk_bytes / self.interval_s / 1e9

    @property
    def chunks(self) -> int:
        return self.emitting * self.steps

    @property
    def chunks_per_stream(self) -> int:
        return self.chunks // self.streams

    def emitters(self, step: int) -> range | list[int]:
        """The streams that emit at ``step``: every stream, or a window of ``per_step`` rotating through them."""
        k = self.emitting
        if k >= self.streams:
            return range(self.streams)
        first = step * k % self.streams
        return [(first + j) % self.streams for j in range(k)]

    def request_id(self, tag: str, stream: int, count: int) -> str:
        """The request of ``stream`` that its chunk number ``count`` belongs to."""
        return f"{tag}-{stream}-{count // self.per_request}"

    def label(self) -> str:
        from omni_plugins.bench.units import format_size

        if self.emitting < self.streams:
            return f"{self.emitting} of {self.streams} x {format_size(self.chunk_bytes)} / {self.interval_s * 1e3:g} ms"
        return f"{self.streams} x {format_size(self.chunk_bytes)} / {self.interval_s * 1e3:g} ms"


class _Request:
    """What a model runner passes the runtime for a request: its ids and whether it finished."""

    __slots__ = ("done", "external_req_id", "request_id")

    def __init__(self, rid: str) -> None:
        self.request_id = self.external_req_id = rid
        self.done = False

    def is_finished(self) -> bool:
        return self.done


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


@dataclass
class Emission:
    """One chunk a producing stage's model thread hands over: its request, its number in it, the payload."""

    request: _Request
    #: the chunk's number within its request
    index: int
    #: the request's last chunk (``request.done`` is set)
    last: bool
    payload: dict[str, Any]


def emissions(traffic: Traffic, tag: str, chunk: Any, start_at: float) -> Iterator[Emission]:
    """``traffic``'s chunks step by step from ``start_at``, paced by its interval (no pause once behind).

    Each payload is a fresh copy of ``chunk`` stamped with its step's scheduled moment: the step's
    outputs exist then, so lag behind the schedule is part of the hand-off.
    """
    requests: list[_Request | None] = [None] * traffic.streams
    counts = [0] * traffic.streams  # chunks each stream has emitted
    next_step = start_at
    for step in range(traffic.steps):
        due = next_step
        for i in traffic.emitters(step):
            count = counts[i]
            counts[i] = count + 1
            index = count % traffic.per_request
            last = index == traffic.per_request - 1
            req = requests[i]
            if req is None or index == 0:
                req = requests[i] = _Request(traffic.request_id(tag, i, count))
            req.done = last
            yield Emission(req, index, last, {"chunk": {"data": chunk.clone()}, "ts": {"send": [due]}})
        next_step += traffic.interval_s
        _sleep_until(next_step)


def stage_config(backend: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"name": backend, "extra": config}


def produce(
    mode: Mode,
    backend: str,
    config: dict[str, Any],
    traffic: Traffic,
    tag: str,
    tuning: dict[str, Any] | None = None,
    *,
    start: Callable[[], float],
    release: Callable[[], Any],
) -> dict[str, Any]:
    """The producing stage: ``traffic``'s chunks, paced by its interval (no pause once behind). Send-side figures.

    ``tuning``: :class:`~omni_plugins.runtime.RuntimeTuning` fields of a ``runtime`` mode. ``start``
    is called once the stage is set up and returns the moment to begin (both stages are set up by
    then); ``release`` returns once the consumer has read everything (a producer's connector may
    free what it published when it closes).
    """
    import torch

    from omni_plugins import StageConfig, create_connector
    from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime

    if mode == "peer":
        from omni_plugins.bench.peer import produce_peer

        return produce_peer(backend, traffic, tag, start, release)
    chunk = torch.ones(traffic.chunk_bytes // 4, dtype=torch.float32)
    rt = conn = sender = None
    if mode.startswith("runtime"):
        rt = StageTransferRuntime(
            StageConfig(stage_id=0, async_chunk=True, custom_process_next_stage_input_func=BUILDER),
            stage_config(backend, config),
            tuning=RuntimeTuning(**(tuning or {})),
        )
    else:
        conn = create_connector(backend, config)
        put: Callable[..., Any] = conn.put
        if mode == "floor":
            from omni_plugins.bench.handoff import SendThread

            sender = SendThread(conn.put)
            put = sender.submit
    try:
        _sleep_until(start())
        cpu0, wall0 = time.process_time(), time.monotonic()
        for chunk_out in emissions(traffic, tag, chunk, wall0):
            req, out = chunk_out.request, chunk_out.payload
            if rt is not None:
                rt.send_chunk(req, out)
                if chunk_out.last:
                    rt.cleanup_finished_request(req.request_id)
            else:
                out["meta"] = {"finished": chunk_out.last, "override_keys": ["chunk"]}
                put(0, 1, f"{req.request_id}_0_{chunk_out.index}", out)
        if rt is not None:
            rt.wait_sends(GRACE_S)
        if sender is not None:
            sender.close()
        sent_s = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        release()
    finally:
        if rt is not None:
            rt.shutdown()
        if sender is not None:
            sender.close()
        if conn is not None:
            conn.close()
    return {"sent_s": sent_s, "cpu_s": cpu}


def consume(
    mode: Mode,
    backend: str,
    config: dict[str, Any],
    traffic: Traffic,
    tag: str,
    tuning: dict[str, Any] | None = None,
    *,
    start: Callable[[], float],
) -> dict[str, Any]:
    """The consuming stage: every chunk of ``traffic``; latencies (s), when it started and the last arrived, CPU.

    ``start`` as for :func:`produce`: the consumer is set up (connector open, first requests
    registered) before it is called.
    """
    if mode.startswith("runtime"):
        return _consume_runtime(backend, config, traffic, tag, start, tuning)
    if mode == "peer":
        from omni_plugins.bench.peer import consume_peer

        return consume_peer(backend, traffic, tag, start)
    return _consume_connector(backend, config, traffic, tag, start, handoff=mode == "floor")


def _deadline(traffic: Traffic, start_at: float) -> float:
    return start_at + traffic.steps * traffic.interval_s + GRACE_S


def _consume_runtime(
    backend: str, config: dict[str, Any], traffic: Traffic, tag: str, start: Callable[[], float], tuning: dict[str, Any] | None
) -> dict[str, Any]:
    from omni_plugins import StageConfig
    from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime

    rt = StageTransferRuntime(
        StageConfig(stage_id=1, async_chunk=True, recv_timeout_s=GRACE_S),
        stage_config(backend, config),
        tuning=RuntimeTuning(**(tuning or {})),
    )
    requests_per_stream = traffic.chunks_per_stream // traffic.per_request
    lat: list[float] = []
    seen: dict[str, int] = {}
    slot_of: dict[str, tuple[int, int]] = {}
    ahead: set[str] = set()  # requests whose successor is registered

    def register(stream: int, r: int) -> None:
        if r < requests_per_stream:
            rid = traffic.request_id(tag, stream, r * traffic.per_request)
            slot_of[rid] = (stream, r)
            rt.register_chunk_recv(_Request(rid))

    def took(rid: str, payload: Any, now: float) -> None:
        sends = payload["ts"]["send"]
        lat.extend(now - t0 for t0 in sends[seen.get(rid, 0) :])
        seen[rid] = len(sends)
        if rid not in ahead:  # its first chunk is here: the scheduler admits the stream's next request
            ahead.add(rid)
            stream, r = slot_of[rid]
            register(stream, r + 1)

    finished = 0
    try:
        for i in range(traffic.streams):
            register(i, 0)
        start_at = last_at = start()
        deadline = _deadline(traffic, start_at)
        cpu0 = time.process_time()
        want = traffic.streams * requests_per_stream
        while finished < want and time.monotonic() < deadline:
            rt.wait_ready(0.05)
            ready = rt.recv_chunk()
            now = time.monotonic()
            for rid, payload in ready.items():
                took(rid, payload, now)
            signals = rt.collect_signals()
            # a chunk that landed between the two calls (also of a request recv_chunk returned) is in
            # the signals and the cache, and will not be returned again: read it there
            late = [
                rid
                for rid in signals.chunk_ready
                if (cached := rt.get_local_stage_payload(rid)) is not None and len(cached["ts"]["send"]) > seen.get(rid, 0)
            ]
            if late:
                now = time.monotonic()
                for rid in late:
                    took(rid, rt.get_local_stage_payload(rid), now)
            if ready or late:
                last_at = now
            for rid in signals.chunk_finished:
                rt.cleanup_finished_request(rid)
                finished += 1
        cpu = time.process_time() - cpu0
        leftover = rt.active_request_count()
    finally:
        rt.shutdown()
    return {
        "latencies": lat,
        "start_at": start_at,
        "last_at": last_at,
        "cpu_s": cpu,
        "missing": traffic.chunks - len(lat),
        "leftover": leftover,
    }


def _consume_connector(
    backend: str, config: dict[str, Any], traffic: Traffic, tag: str, start: Callable[[], float], *, handoff: bool = False
) -> dict[str, Any]:
    """One thread on ``wait_any`` + ``get``; ``handoff``: that thread hands each chunk to the caller's (the floor)."""
    from omni_plugins import create_connector

    conn = create_connector(backend, config)
    lat: list[float] = []

    def key(stream: int, count: int) -> str:
        return f"{traffic.request_id(tag, stream, count)}_0_{count % traffic.per_request}"

    as_set = conn.capabilities.wait_any_sets  # as the runtime does: the waited set itself, not a copy per wait

    def arrivals(deadline: float) -> Iterator[dict[str, Any]]:
        pending = {key(i, 0): (i, 0) for i in range(traffic.streams)}
        while pending and time.monotonic() < deadline:
            for k in conn.wait_any(pending.keys() if as_set else list(pending), 0.05):
                got = conn.get(0, 1, k, timeout=None)
                if got is None:
                    continue
                i, count = pending.pop(k)
                if count + 1 < traffic.chunks_per_stream:
                    pending[key(i, count + 1)] = (i, count + 1)
                yield got.data

    try:
        start_at = last_at = start()
        cpu0 = time.process_time()
        chunks = arrivals(_deadline(traffic, start_at))
        if handoff:
            from omni_plugins.bench.handoff import on_own_thread

            chunks = on_own_thread(chunks)
        for data in chunks:
            last_at = time.monotonic()
            lat.append(last_at - data["ts"]["send"][0])
        cpu = time.process_time() - cpu0
    finally:
        conn.close()
    return {"latencies": lat, "start_at": start_at, "last_at": last_at, "cpu_s": cpu, "missing": traffic.chunks - len(lat), "leftover": 0}


def summarize(traffic: Traffic, consumed: dict[str, Any], produced: dict[str, Any]) -> dict[str, float]:
    """One job's figures: p50/p99 hand-off (ms), delivered and sent throughput (GB/s), CPU per chunk (us) of each side."""
    lat = sorted(consumed["latencies"])
    delivered = len(lat)
    span = max(consumed["last_at"] - consumed["start_at"], 1e-9)
    return {
        "p50_ms": percentile(lat, 0.5) * 1e3 if lat else float("nan"),
        "p99_ms": percentile(lat, 0.99) * 1e3 if lat else float("nan"),
        "delivered_gbps": delivered * traffic.chunk_bytes / span / 1e9,
        "sent_gbps": traffic.chunks * traffic.chunk_bytes / max(produced["sent_s"], 1e-9) / 1e9,
        "cpu_us_per_chunk": (consumed["cpu_s"] + produced["cpu_s"]) / max(delivered, 1) * 1e6,
        "consumer_cpu_us_per_chunk": consumed["cpu_s"] / max(delivered, 1) * 1e6,
        "producer_cpu_us_per_chunk": produced["cpu_s"] / max(delivered, 1) * 1e6,
        "missing": float(consumed["missing"]),
        "leftover": float(consumed["leftover"]),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile of already sorted values (nearest rank)."""
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- stage processes ----------------------------------------------------------------------------
def _serve(conn: Any) -> None:
    """A spawned stage process: run jobs until ``None``.

    A job is ``(role, "module:function", args)``: the function is called with ``args`` and
    ``start`` (and, for a ``produce`` job, ``release``). ``start`` answers ``ready`` (the stage is
    set up) and returns the moment the parent sends once every stage is ready; ``release``
    returns when the parent says the consumers have read everything.
    """
    import os

    import torch

    from omni_plugins.importing import import_string

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)

    def start() -> float:
        conn.send(("ready", None))
        _, start_at = conn.recv()
        return float(start_at)

    while True:
        job = conn.recv()
        if job is None:
            return
        role, target, args = job
        try:
            fn = import_string(target)
            out = fn(*args, start=start, release=conn.recv) if role == "produce" else fn(*args, start=start)
            conn.send(("ok", out))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


Job = tuple[str, str, tuple[Any, ...]]


class StageProcesses:
    """Spawned stage processes, reused for every job of a section (one job per process at a time).

    ``pinned``: each process (and every thread it starts) runs on a CPU of its own, where the OS
    lets the bench choose and there are enough CPUs (:attr:`pinned` says whether it happened).
    """

    def __init__(self, count: int, *, pinned: bool = False) -> None:
        import multiprocessing as mp
        import os

        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        ctx = mp.get_context("spawn")
        self._procs = []
        self._conns = []
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True, name=f"omni-bench-stage{i}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.pinned = pinned and _pin_apart([p.pid for p in self._procs if p.pid is not None])

    def run(self, jobs: list[Job], timeout: float) -> list[dict[str, Any]]:
        """Job ``i`` in process ``i``; every stage set up, then all started at the same moment.

        Consumers' results are awaited first (up to ``timeout`` s), then the producers are released.
        Returns each job's result, in order. A failure closes the processes (they are not reusable).
        """
        try:
            for conn, job in zip(self._conns, jobs, strict=False):
                conn.send(job)
            for i in range(len(jobs)):
                self._answer(i, 300, "ready")
            start_at = time.monotonic() + 0.02
            for conn in self._conns[: len(jobs)]:
                conn.send(("go", start_at))
            out: list[dict[str, Any]] = [{} for _ in jobs]
            for i, (role, _, _) in enumerate(jobs):
                if role != "produce":
                    out[i] = self._answer(i, timeout)
            for i, (role, _, _) in enumerate(jobs):
                if role == "produce":
                    self._conns[i].send("release")
                    out[i] = self._answer(i, GRACE_S + 60)
            return out
        except BaseException:
            self.close()
            raise

    def _answer(self, which: int, timeout: float, expect: str = "ok") -> dict[str, Any]:
        conn, proc = self._conns[which], self._procs[which]
        if not conn.poll(timeout):
            raise TimeoutError(f"the {proc.name} process did not answer within {timeout:.0f}s (alive: {proc.is_alive()})")
        status, out = conn.recv()
        if status == "error":
            raise RuntimeError(f"the {proc.name} process failed: {out}")
        if status != expect:
            raise RuntimeError(f"the {proc.name} process answered {status!r}, expected {expect!r}")
        return dict(out or {})

    def close(self) -> None:
        """Stop every process (idempotent): ask them to exit, kill what does not."""
        for conn, proc in zip(self._conns, self._procs, strict=True):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
            conn.close()
        self._conns, self._procs = [], []


def _pin_apart(pids: list[int]) -> bool:
    """Each of ``pids`` on one CPU of the ones this process may use, a different one each; False where it cannot.

    Set before the processes start their threads (they start them per job), which inherit it.
    """
    import os

    if not hasattr(os, "sched_setaffinity"):
        return False
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < len(pids):
        return False
    try:
        for pid, cpu in zip(pids, cpus, strict=False):
            os.sched_setaffinity(pid, {cpu})
    except OSError:
        return False
    return True


class StagePair(StageProcesses):
    """A producer process and a consumer process moving :class:`Traffic` (the load, scaling and peer sections)."""

    def __init__(self, *, pinned: bool = False) -> None:
        super().__init__(2, pinned=pinned)

    def run_traffic(
        self, mode: Mode, backend: str, config: dict[str, Any], traffic: Traffic, tag: str, tuning: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """One job of ``traffic`` in ``mode`` (a ``runtime`` mode with ``tuning``); returns :func:`summarize`'s figures."""
        args = (mode, backend, config, traffic, tag, tuning)
        produced, consumed = self.run(
            [("produce", f"{__name__}:produce", args), ("consume", f"{__name__}:consume", args)],
            traffic.steps * traffic.interval_s + GRACE_S + 60,
        )
        return summarize(traffic, consumed, produced)
