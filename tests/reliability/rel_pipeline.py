"""Two-stage streaming pipelines through ``StageTransferRuntime``, across real processes.

Used by the reliability tests and by ``benchmarks/soak.py`` (imported by path,
not a package). Three pieces:

* payloads: :func:`chunk_output` makes chunk ``i`` of a request (one row whose
  value is derived from the request id and ``i``), :func:`verify_merged` checks an
  ``"ar"``-merged stream row by row, so a lost, duplicated or reordered chunk fails;
* :func:`produce` (stage 0) and :class:`StreamConsumer` (stage 1): the model-thread
  side of each stage, exactly as a runner would drive the runtime;
* :class:`StageProcess`: runs either side in a separate Python process (this file
  as a script), driven by JSON lines on stdin/stdout. Every wait is bounded and
  :meth:`StageProcess.kill` / :meth:`StageProcess.close` never block for long.

Payload builder: ``omni_plugins.testing.builders.passthrough`` (``meta.finished``
comes from ``request.is_finished()``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from omni_plugins.config.models import StageConfig
from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime

BUILDER = "omni_plugins.testing.builders.passthrough"
HERE = Path(__file__).resolve()

#: pids of every process this module (or a test, via :func:`track`) started; the suite checks they are gone
STARTED: list[int] = []


def track(pid: int | None) -> None:
    """Record a process started for a test (checked at the end of the session)."""
    if pid is not None:
        STARTED.append(pid)


#: quick joins and retries: a fault test must not sit in 5 s joins
TUNING = {"join_timeout_s": 3.0, "drain_timeout_s": 3.0, "retry_backoff_s": 0.01}


# ---------------------------------------------------------------------------------------------- payloads
def row_value(request_id: str, index: int) -> float:
    """The value every element of chunk ``index`` of ``request_id`` carries (exact in float32)."""
    return float(zlib.crc32(f"{request_id}/{index}".encode()) % 1_000_003)


def chunk_output(request_id: str, index: int, elems: int) -> dict[str, Any]:
    """Model output of one step: one row of ``elems`` floats plus the chunk index."""
    return {"embed": {"decode": torch.full((1, elems), row_value(request_id, index))}, "ids": {"output": [index]}}


def verify_merged(request_id: str, payload: Any, chunks: int) -> str | None:
    """None if ``payload`` is exactly chunks 0..chunks-1 of ``request_id`` merged in order, else why not."""
    if not isinstance(payload, dict):
        return f"payload is a {type(payload).__name__}"
    decode = payload.get("embed", {}).get("decode")
    ids = payload.get("ids", {}).get("output")
    if ids != list(range(chunks)):
        return f"chunk indexes {ids} != 0..{chunks - 1}"
    if not isinstance(decode, torch.Tensor) or decode.dim() != 2 or decode.shape[0] != chunks:
        return f"embed.decode has shape {getattr(decode, 'shape', None)}, want ({chunks}, n)"
    for i in range(chunks):
        if not bool((decode[i] == row_value(request_id, i)).all()):
            return f"row {i} holds the wrong values"
    return None


class Req(SimpleNamespace):
    """The request object a runner passes to the runtime."""

    def __init__(self, request_id: str, done: bool = False) -> None:
        super().__init__(request_id=request_id, external_req_id=request_id, done=done)

    def is_finished(self) -> bool:
        return bool(self.done)


# ---------------------------------------------------------------------------------------------- runtimes
def make_runtime(stage_id: int, connector: Mapping[str, Any], *, recv_timeout_s: float = 30.0, **tuning: Any) -> StageTransferRuntime:
    """Stage 0 (producer, streaming, passthrough builder) or stage 1 (``"ar"`` consumer)."""
    stage = StageConfig(
        stage_id=stage_id,
        async_chunk=True,
        worker_type="ar",
        custom_process_next_stage_input_func=BUILDER if stage_id == 0 else None,
        recv_timeout_s=recv_timeout_s,
    )
    return StageTransferRuntime(stage, dict(connector), tuning=RuntimeTuning(**{**TUNING, **tuning}))


@dataclass
class Plan:
    """One request as the producer streams it: ``chunks`` chunks, or only ``abort_after`` then abort."""

    id: str
    chunks: int = 4
    elems: int = 256
    abort_after: int | None = None

    @property
    def aborted(self) -> bool:
        return self.abort_after is not None

    @property
    def sent(self) -> int:
        return self.chunks if self.abort_after is None else min(self.abort_after, self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "chunks": self.chunks, "elems": self.elems, "abort_after": self.abort_after}


def produce(
    rt: StageTransferRuntime,
    plans: Iterable[Plan],
    *,
    step_delay: float = 0.0,
    on_step: Callable[[int], None] | None = None,
    drain_timeout: float = 60.0,
) -> dict[str, Any]:
    """Stream every plan one chunk per step (all requests interleaved), then clean up.

    Aborted requests stop after ``abort_after`` chunks. After the sends drained
    (bounded) every request is cleaned up (``aborted=True`` for aborted ones).
    Returns ``{"drained", "failed", "active"}`` (failed: ids the signals reported).
    """
    plans = list(plans)
    reqs = {p.id: Req(p.id) for p in plans}
    failed: set[str] = set()
    for index in range(max((p.chunks for p in plans), default=0)):
        for p in plans:
            if index >= p.sent:
                continue
            req = reqs[p.id]
            req.done = not p.aborted and index == p.chunks - 1
            rt.send_chunk(req, chunk_output(p.id, index, p.elems))
        if on_step is not None:
            on_step(index)
        if step_delay:
            time.sleep(step_delay)
    drained = rt.wait_sends(drain_timeout)
    failed |= rt.collect_signals().failed
    for p in plans:
        rt.cleanup_finished_request(p.id, aborted=p.aborted)
    return {"drained": drained, "failed": sorted(failed), "active": rt.active_request_count()}


@dataclass
class Outcome:
    """What the consumer saw of one request."""

    status: str = "pending"  # pending | finished | failed | timed_out
    rows: int = 0
    error: str | None = None


@dataclass
class StreamConsumer:
    """Stage 1's model-thread loop: register, collect signals, verify finished streams, clean up."""

    rt: StageTransferRuntime
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    expected_chunks: dict[str, int] = field(default_factory=dict)

    def register(self, ids: Iterable[str], *, chunks: int | Mapping[str, int] = 4) -> None:
        for rid in ids:
            self.outcomes[rid] = Outcome()
            self.expected_chunks[rid] = chunks if isinstance(chunks, int) else chunks[rid]
            self.rt.register_chunk_recv(Req(rid))

    def step(self, wait: float = 0.02) -> None:
        """One model step: wait (bounded) for arrivals, then drain payloads and signals."""
        self.rt.wait_ready(wait)
        ready = self.rt.recv_chunk()
        signals = self.rt.collect_signals()
        for rid, payload in ready.items():
            out = self.outcomes.get(rid)
            if out is not None and isinstance(payload, dict):
                decode = payload.get("embed", {}).get("decode")
                out.rows = int(decode.shape[0]) if isinstance(decode, torch.Tensor) else out.rows
        for rid in signals.chunk_finished:
            out = self.outcomes.setdefault(rid, Outcome())
            # the cache, not ``ready``: the finishing chunk may have landed between recv_chunk and
            # collect_signals (it is reported, and the runner reads it from the local cache)
            payload = self.rt.get_local_stage_payload(rid)
            out.error = verify_merged(rid, payload, self.expected_chunks.get(rid, -1))
            out.status = "finished"
            self.rt.cleanup_finished_request(rid)
        for rid in signals.failed:
            self.outcomes.setdefault(rid, Outcome()).status = "failed"
        for rid in signals.timed_out:
            self.outcomes.setdefault(rid, Outcome()).status = "timed_out"

    def run_until(self, done: Callable[[StreamConsumer], bool], timeout: float) -> bool:
        """Step until ``done(self)`` or ``timeout`` seconds passed; returns whether ``done`` held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.step()
            if done(self):
                return True
        return False

    def settled(self, ids: Iterable[str]) -> bool:
        return all(self.outcomes[i].status != "pending" for i in ids)

    def abort(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self.rt.cleanup_finished_request(rid, aborted=True)
            self.outcomes.pop(rid, None)
            self.expected_chunks.pop(rid, None)

    def forget(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self.outcomes.pop(rid, None)
            self.expected_chunks.pop(rid, None)


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------- processes
class StageProcess:
    """One stage runtime in a child process (this file run as a script), driven by JSON lines.

    ``spec``: ``{"stage_id": 0|1, "connector": {name, extra}, "recv_timeout_s": float,
    "tuning": {...}, "env": {...}}``. Commands: ``produce``, ``register``, ``consume``,
    ``abort``, ``state``, ``exit`` (see :func:`_serve`).
    """

    def __init__(self, spec: Mapping[str, Any], *, start_timeout: float = 60.0) -> None:
        self.spec = dict(spec)
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 -- lives as long as the process; closed in _finish
        env = dict(os.environ, **self.spec.get("env", {}))
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
            env=env,
        )
        track(self.proc.pid)
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.wait_event("ready", start_timeout)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._events.put(json.loads(line))
        self._events.put(None)

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            self._stderr.seek(0)
            return self._stderr.read()[-n:]
        except (OSError, ValueError):
            return ""

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """The next event called ``name`` (others are kept in ``seen``); AssertionError on timeout or exit."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._dump_stacks()
                raise AssertionError(f"stage process {self.pid}: no {name!r} event within {timeout}s; stderr:\n{self.stderr_tail()}")
            try:
                event = self._events.get(timeout=left)
            except queue.Empty:
                continue
            if event is None:
                self._events.put(None)
                raise AssertionError(f"stage process {self.pid} exited ({self.proc.poll()}) before {name!r}; stderr:\n{self.stderr_tail()}")
            self.seen.append(event)
            if event.get("event") == "error":
                raise AssertionError(f"stage process {self.pid} failed: {event.get('error')}")
            if event.get("event") == name:
                return event

    def _dump_stacks(self) -> None:
        """Have a live child write every thread's stack to its stderr (faulthandler on SIGUSR1), for the error."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                return
            time.sleep(1.0)

    def call(self, op: str, reply: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.wait_event(reply, timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process by pid and reap it (bounded)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(15)
        self._finish()

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask for an orderly exit (runtime shutdown, connector close); SIGKILL if it does not come."""
        if self.proc.poll() is None:
            try:
                self.call("exit", "bye", timeout=timeout)
                self.proc.wait(timeout)
            except (AssertionError, OSError, subprocess.TimeoutExpired, ValueError):
                self.kill()
        self._finish()
        return self.proc.returncode

    def _finish(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        self._reader.join(5)
        self._stderr.close()

    def __enter__(self) -> StageProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill() if exc[0] is not None else self.close()


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}, default=str), flush=True)


def _serve(spec: dict[str, Any]) -> None:
    """The child side of :class:`StageProcess`."""
    rt = make_runtime(
        int(spec["stage_id"]), spec["connector"], recv_timeout_s=float(spec.get("recv_timeout_s", 30.0)), **spec.get("tuning", {})
    )
    consumer = StreamConsumer(rt)
    _emit("ready", pid=os.getpid())
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "produce":
                plans = [Plan(**p) for p in cmd["plans"]]
                notify = bool(cmd.get("notify_steps"))
                result = produce(
                    rt,
                    plans,
                    step_delay=float(cmd.get("step_delay", 0.0)),
                    on_step=(lambda i: _emit("step", index=i)) if notify else None,
                    drain_timeout=float(cmd.get("drain_timeout", 60.0)),
                )
                _emit("produced", **result)
            elif op == "register":
                consumer.register(cmd["ids"], chunks=cmd.get("chunks", 4))
                _emit("registered", ids=cmd["ids"])
            elif op == "consume":
                waiting = list(consumer.outcomes)
                consumer.run_until(lambda c, ids=waiting: c.settled(ids), float(cmd.get("timeout", 30.0)))  # type: ignore[misc]
                _emit("consumed", outcomes={k: vars(v) for k, v in consumer.outcomes.items()})
            elif op == "abort":
                consumer.abort(cmd["ids"])
                _emit("aborted", ids=cmd["ids"])
            elif op == "state":
                _emit("state", active=rt.active_request_count(), rss=rss_bytes(), debug=rt.debug_state())
            elif op == "exit":
                rt.shutdown()
                _emit("bye", active=rt.active_request_count())
                return
            else:
                _emit("error", error=f"unknown op {op!r}")
        except Exception as exc:  # report, keep serving
            _emit("error", error=f"{op}: {type(exc).__name__}: {exc}")
    rt.shutdown()  # stdin closed: the parent is gone


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    import logging

    logging.basicConfig(level=os.environ.get("OMNI_REL_LOG", "WARNING"), stream=sys.stderr)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # StageProcess._dump_stacks
    _serve(json.loads(sys.argv[1]))
