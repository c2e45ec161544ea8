"""Two-process put+get measurement: the parent produces, a spawned child consumes.

Per payload size and mode (``raw`` baseline, ``omni`` connector), one
operation is: the parent puts the payload and tells the child the key over a
pipe; the child gets it (an owned copy) and acks. The time from the start of
the put to the ack is one sample (the full hand-off). Modes are interleaved
in rounds so the drift of a noisy machine hits both alike; medians are
reported and the ratio omni/raw is computed from the same run.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from omni_plugins.bench.drivers import TIMEOUT_S, DriverSpec, make_raw

logger = logging.getLogger(__name__)

MODES = ("raw", "omni")
ROUNDS = 3


def iterations(size: int, quick: bool) -> tuple[int, int]:
    """(warm-up, timed) operations per mode for a payload size (bounded by a byte budget)."""
    budget = (256 << 20) if quick else (2 << 30)
    timed = int(max(4 if quick else 10, min(200 if quick else 1000, budget // max(size, 1))))
    return max(1, min(10, timed // 10)), timed


def _child(spec: DriverSpec, conn: Connection) -> None:
    """Consumer: answer ``("get", mode, key, nbytes)`` with ``("ok", nbytes)`` until ``("stop",)``."""
    torch.set_num_threads(1)
    raw = connector = None
    try:
        from omni_plugins import create_connector

        raw = make_raw(spec, producer=False)
        connector = create_connector(spec.backend, spec.config)
        conn.send(("ready", raw.handshake()))
        raw.connect(conn.recv())
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, mode, key, nbytes = msg
            if mode == "raw":
                got = raw.get(key, nbytes).numel()
            else:
                result = connector.get(0, 1, key, timeout=TIMEOUT_S)
                if result is None:
                    raise TimeoutError(f"omni get of {key} timed out")
                got = result.data["t"].numel()
                del result
            conn.send(("ok", got))
        conn.send(("bye", None))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if connector is not None:
            connector.close()
        if raw is not None:
            raw.close()


@dataclass
class SizeResult:
    size: int
    raw_s: list[float]
    omni_s: list[float]

    def summary(self) -> dict[str, Any]:
        raw, omni = statistics.median(self.raw_s), statistics.median(self.omni_s)
        return {
            "size": self.size,
            "ops": len(self.raw_s),
            "raw_p50_ms": raw * 1e3,
            "omni_p50_ms": omni * 1e3,
            "raw_gbps": self.size / raw / 1e9,
            "omni_gbps": self.size / omni / 1e9,
            "ratio": raw / omni,  # omni throughput as a fraction of raw
        }


def measure(spec: DriverSpec, sizes: list[int], quick: bool, tick: Callable[[int], None] = lambda n: None) -> list[dict[str, Any]]:
    """Run both modes for every size; returns one summary per size."""
    from omni_plugins import create_connector

    # Two processes on two cores: OpenMP threads spinning after a parallel copy steal the other
    # process's core. One intra-op thread and passive waiting, for both modes alike.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(spec, child_end), daemon=True, name=f"omni-bench-{spec.backend}")
    raw = make_raw(spec, producer=True)
    connector = create_connector(spec.backend, spec.config)
    proc.start()
    try:
        _kind, data = _recv(parent, proc, 120.0)
        parent.send(raw.handshake())
        raw.connect(data)
        out = []
        for size in sizes:
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            warm, timed = iterations(size, quick)
            samples: dict[str, list[float]] = {m: [] for m in MODES}
            per_round = max(1, timed // ROUNDS)
            seq = 0
            for rnd in range(ROUNDS + 1):  # round 0 is the warm-up
                for mode in MODES:
                    for _ in range(warm if rnd == 0 else per_round):
                        seq += 1
                        key = f"bench-{size}-{seq}"
                        t0 = time.perf_counter()
                        if mode == "raw":
                            raw.put(key, payload)
                        else:
                            connector.put(0, 1, key, {"t": payload})
                        parent.send(("get", mode, key, size))
                        _recv(parent, proc, TIMEOUT_S * 2)
                        if rnd:
                            samples[mode].append(time.perf_counter() - t0)
                            tick(1)
            out.append(SizeResult(size, samples["raw"], samples["omni"]).summary())
        parent.send(("stop",))
        _recv(parent, proc, 30.0)
        return out
    finally:
        torch.set_num_threads(threads)
        proc.join(30)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
        connector.close()
        raw.close()


def _recv(conn: Connection, proc: Any, timeout: float) -> tuple[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError(f"bench consumer did not answer within {timeout:.0f}s (alive: {proc.is_alive()})")
    kind, data = conn.recv()
    if kind == "error":
        raise RuntimeError(f"bench consumer failed: {data}")
    return kind, data
