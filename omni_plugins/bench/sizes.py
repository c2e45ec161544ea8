"""The size curve: one backend's lanes at every size, producer and consumer in separate processes.

The parent process is the producer, a spawned child the consumer; each builds its own end of
every lane (its own connector, its own client connections). One operation: the parent puts a
payload (``t0`` .. ``t1``), tells the child the key over a pipe, the child gets it (``t2`` ..
``t3``: an owned copy, or views for a views variant) and answers with its two timestamps. Both
processes read the same clock (``time.perf_counter``: ``CLOCK_MONOTONIC``, system-wide), so:

- ``put`` = ``t1 - t0`` (producer), ``get`` = ``t3 - t2`` (consumer), ``transfer`` = put + get: the
  work of the two ends, without the harness's notice and reply hops;
- ``one_way`` = ``t3 - t0``: put start to the consumer holding the data, the notice hop included
  and the reply hop not.

Lanes are interleaved in rounds so that the drift of a noisy machine hits them alike; medians are
reported and every ratio is between lanes of the same run. At small sizes a round trip (the
payload there and back, each side blocked in ``get``) is measured against the same bytes there
and back over the harness's pipe.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from omni_plugins.bench.lanes import TIMEOUT_S, Lane, LaneSpec, make_lane
from omni_plugins.bench.schema import Value

logger = logging.getLogger(__name__)

#: timed rounds per size (lanes interleaved within each); round 0 warms up and is not recorded
ROUNDS = 3
#: round trips are measured up to this size (latency matters there; bandwidth above)
ROUND_TRIP_MAX = 64 << 10
PIPE = "pipe"


def iterations(size: int, quick: bool) -> tuple[int, int]:
    """(warm-up, timed) operations per lane for a payload size, bounded by a byte budget."""
    budget = (128 << 20) if quick else (2 << 30)
    timed = int(max(3 if quick else 9, min(60 if quick else 900, budget // max(size, 1))))
    timed -= timed % ROUNDS
    return max(1, min(10, timed // 10)), timed


def round_trips(quick: bool) -> int:
    return 30 if quick else 600


def planned_ops(lanes: int, round_trip_lanes: int, sizes: list[int], quick: bool) -> int:
    """Operations :func:`measure` will time (for a progress bar)."""
    total = sum(lanes * iterations(s, quick)[1] for s in sizes)
    total += sum(round_trip_lanes * round_trips(quick) for s in sizes if s <= ROUND_TRIP_MAX)
    return total


@dataclass
class _Samples:
    put: list[float] = field(default_factory=list)
    get: list[float] = field(default_factory=list)
    transfer: list[float] = field(default_factory=list)
    one_way: list[float] = field(default_factory=list)
    notice: list[float] = field(default_factory=list)

    def add(self, t0: float, t1: float, t2: float, t3: float) -> None:
        self.put.append(t1 - t0)
        self.get.append(t3 - t2)
        self.transfer.append((t1 - t0) + (t3 - t2))
        self.one_way.append(t3 - t0)
        self.notice.append(t2 - t1)

    def medians_us(self) -> dict[str, float]:
        return {k: statistics.median(getattr(self, k)) * 1e6 for k in ("put", "get", "transfer", "one_way", "notice")}


def _consumer(lanes: list[LaneSpec], conn: Connection) -> None:
    """The child: build every lane's consumer end, then answer requests until ``stop``."""
    import torch

    torch.set_num_threads(1)
    ends: dict[str, Lane] = {}
    try:
        for spec in lanes:
            ends[spec.label] = make_lane(spec, producer=False)
        conn.send(("ready", {label: dict(end.handshake()) for label, end in ends.items()}))
        peers = conn.recv()
        for label, end in ends.items():
            end.connect(peers[label])
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "get":
                _, label, key, nbytes, token = msg
                t2 = time.perf_counter()
                got = ends[label].get(key, nbytes, token)
                t3 = time.perf_counter()
                if got.numel() * got.element_size() != nbytes:
                    raise RuntimeError(f"{label}: got {got.numel() * got.element_size()} bytes of {nbytes}")
                del got
                conn.send(("ok", (t2, t3)))
            else:  # ("echo", label, n, prefix): n round trips
                _, label, n, prefix = msg
                _echo(conn, ends.get(label), n, prefix)
        conn.send(("bye", None))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        for end in ends.values():
            try:
                end.close()
            except Exception:
                logger.debug("closing a lane end failed", exc_info=True)


def _echo(conn: Connection, end: Lane | None, n: int, prefix: str) -> None:
    """Send every payload back: over the pipe (``end`` None) or through the lane (blocked in ``get``)."""
    for i in range(n):
        if end is None:
            conn.send_bytes(conn.recv_bytes())
        else:
            got = end.get(f"{prefix}{i}", 0, None)
            end.put(f"{prefix}{i}r", got)
            del got


def consumer_error(conn: Connection) -> str | None:
    """The error the consumer sent, if it sent one: when the producer's side of a round trip fails
    (a get that found nothing), the consumer's failure is usually why, and the message says so."""
    if not conn.poll(0):
        return None
    try:
        kind, data = conn.recv()
    except (EOFError, OSError):
        return None
    return str(data) if kind == "error" else None


def _recv(conn: Connection, proc: Any, timeout: float) -> tuple[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError(f"bench consumer did not answer within {timeout:.0f}s (alive: {proc.is_alive()})")
    kind, data = conn.recv()
    if kind == "error":
        raise RuntimeError(f"bench consumer failed: {data}")
    return kind, data


class _Pair:
    """The producer's ends of every lane and the consumer process holding the other ends."""

    def __init__(self, lanes: list[LaneSpec]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_consumer, args=(lanes, child_end), daemon=True, name="omni-bench-consumer")
        self.ends: dict[str, Lane] = {}
        self.proc.start()
        child_end.close()
        for spec in lanes:
            self.ends[spec.label] = make_lane(spec, producer=True)
        _, theirs = _recv(self.conn, self.proc, 180.0)
        self.conn.send({label: dict(end.handshake()) for label, end in self.ends.items()})
        for label, end in self.ends.items():
            end.connect(theirs[label])

    def transfer(self, label: str, key: str, payload: Any, nbytes: int) -> tuple[float, float, float, float]:
        end = self.ends[label]
        t0 = time.perf_counter()
        token = end.put(key, payload)
        t1 = time.perf_counter()
        self.conn.send(("get", label, key, nbytes, token))
        _, (t2, t3) = _recv(self.conn, self.proc, TIMEOUT_S * 2)
        return t0, t1, t2, t3

    def round_trips(self, label: str, payload: Any, n: int, prefix: str) -> list[float]:
        """``n`` round trips of ``payload``: through the lane, or over the pipe (``label`` :data:`PIPE`)."""
        self.conn.send(("echo", label, n, prefix))
        out = []
        if label == PIPE:
            data = payload.numpy().tobytes()
            for _ in range(n):
                t0 = time.perf_counter()
                self.conn.send_bytes(data)
                self.conn.recv_bytes()
                out.append(time.perf_counter() - t0)
            return out
        end = self.ends[label]
        try:
            for i in range(n):
                t0 = time.perf_counter()
                end.put(f"{prefix}{i}", payload)
                got = end.get(f"{prefix}{i}r", 0, None)
                out.append(time.perf_counter() - t0)
                del got
        except Exception as exc:
            failed = consumer_error(self.conn)
            if failed is None:
                raise
            raise RuntimeError(f"bench consumer failed: {failed}") from exc
        return out

    def close(self) -> None:
        """Stop the consumer (its ends close first: a backend's close may take a while) and close ours."""
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
                _recv(self.conn, self.proc, 120.0)
        except (OSError, TimeoutError, RuntimeError) as exc:  # measured already: a stuck close loses nothing
            logger.warning("bench consumer did not stop cleanly: %s", exc)
        finally:
            self.proc.join(10)
            if self.proc.exitcode is None:
                self.proc.kill()
                self.proc.join(5)
            for end in self.ends.values():
                try:
                    end.close()
                except Exception:
                    logger.debug("closing a lane end failed", exc_info=True)


def measure(
    backend: str,
    lanes: list[LaneSpec],
    sizes: list[int],
    quick: bool,
    tick: Callable[[int], None] = lambda n: None,
) -> list[dict[str, Value]]:
    """Every lane at every size (and round trips at small sizes); one row per connector lane and size.

    ``lanes`` holds the raw baseline (label ``raw``), optionally the floor (``floor``), the connector
    (``connector``) and its variants (``connector:<variant>``).
    """
    rows: list[dict[str, Value]] = []
    for size, medians, trips in measure_lanes(lanes, sizes, quick, tick):
        for label in medians:
            if label.startswith("connector"):
                rows.append(_row(backend, label, size, iterations(size, quick)[1], medians, trips))
    return rows


def measure_lanes(
    lanes: list[LaneSpec],
    sizes: list[int],
    quick: bool,
    tick: Callable[[int], None] = lambda n: None,
    round_trips: bool = True,
) -> list[tuple[int, dict[str, dict[str, float]], dict[str, float]]]:
    """Per size: the median put, get, transfer, one-way and notice (us) of every lane, and round trips (s).

    Round trips (at sizes up to :data:`ROUND_TRIP_MAX`, when ``round_trips``) go through the
    connector lanes and over the pipe, after the transfers.
    """
    import torch

    # Two processes on two cores: OpenMP threads spinning after a parallel copy steal the other
    # process's core. One intra-op thread and passive waiting, for every lane alike.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    labels = [spec.label for spec in lanes]
    out: list[tuple[int, dict[str, dict[str, float]], dict[str, float]]] = []
    try:
        pair = _Pair(lanes)
        try:
            seq = 0
            for size in sizes:
                payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
                warm, timed = iterations(size, quick)
                samples = {label: _Samples() for label in labels}
                for rnd in range(ROUNDS + 1):  # round 0 warms up
                    for label in labels:
                        for _ in range(warm if rnd == 0 else timed // ROUNDS):
                            seq += 1
                            t = pair.transfer(label, f"bench-{size}-{seq}", payload, size)
                            if rnd:
                                samples[label].add(*t)
                                tick(1)
                out.append((size, {label: s.medians_us() for label, s in samples.items()}, {}))
        finally:
            pair.close()
        small = [size for size in sizes if size <= ROUND_TRIP_MAX]
        connectors = [spec for spec in lanes if spec.kind == "connector"] if round_trips else []
        if small and connectors:
            trips = _round_trips_per_size(connectors, small, quick, tick)
            for size, _, found in out:
                found.update(trips.get(size, {}))
        return out
    finally:
        torch.set_num_threads(threads)


def _round_trips_per_size(lanes: list[LaneSpec], sizes: list[int], quick: bool, tick: Callable[[int], None]) -> dict[int, dict[str, float]]:
    """Round trips at each size through every lane and over the pipe, in a pair of their own.

    A lane whose round trip fails (a backend whose consumer cannot answer by a put of its own)
    leaves its sizes without round trips, logged; its transfers were measured already.
    """
    import torch

    out: dict[int, dict[str, float]] = {}
    try:
        pair = _Pair(lanes)
    except Exception as exc:
        logger.warning("round trips not measured: %s", exc)
        return out
    try:
        for size in sizes:
            payload = torch.randint(0, 255, (size,), dtype=torch.uint8)
            out[size] = _round_trips(pair, [spec.label for spec in lanes], payload, quick, tick)
    except Exception as exc:
        logger.warning("round trips through %s failed: %s", ", ".join(spec.label for spec in lanes), exc)
    finally:
        pair.close()
    return out


def _round_trips(pair: _Pair, connectors: list[str], payload: Any, quick: bool, tick: Callable[[int], None]) -> dict[str, float]:
    """Median round trip (s) per connector lane and over the pipe, interleaved in rounds."""
    n = round_trips(quick)
    per_round = max(1, n // ROUNDS)
    got: dict[str, list[float]] = {label: [] for label in [PIPE, *connectors]}
    for rnd in range(ROUNDS + 1):
        for label in got:
            times = pair.round_trips(label, payload, max(3, per_round // 10) if rnd == 0 else per_round, f"rt-{rnd}-{label}-")
            if rnd:
                got[label] += times
                tick(len(times))
    return {label: statistics.median(v) for label, v in got.items()}


def _row(
    backend: str, label: str, size: int, ops: int, medians: Mapping[str, dict[str, float]], trips: Mapping[str, float]
) -> dict[str, Value]:
    raw, conn = medians["raw"], medians[label]
    variant = label.partition(":")[2]
    row: dict[str, Value] = {"backend": backend, "variant": variant, "size": size, "ops": ops}
    row |= {f"raw_{k}_us": v for k, v in raw.items()}
    row |= {f"connector_{k}_us": v for k, v in conn.items()}
    row["raw_gbps"] = size / raw["transfer"] / 1e3
    row["connector_gbps"] = size / conn["transfer"] / 1e3
    row["ratio"] = raw["transfer"] / conn["transfer"]
    row["put_ratio"] = raw["put"] / conn["put"]
    row["get_ratio"] = raw["get"] / conn["get"]
    row["cost"] = conn["transfer"] / raw["transfer"]
    if "floor" in medians:
        floor = medians["floor"]
        row |= {f"floor_{k}_us": v for k, v in floor.items()}
        row["floor_ratio"] = raw["transfer"] / floor["transfer"]
        row["floor_put_ratio"] = raw["put"] / floor["put"]
        row["floor_get_ratio"] = raw["get"] / floor["get"]
        row["floor_cost"] = floor["transfer"] / raw["transfer"]
    if label in trips:
        row["round_trip_us"] = trips[label] * 1e6
        row["pipe_round_trip_us"] = trips[PIPE] * 1e6
        row["round_trip_vs_pipe"] = trips[label] / trips[PIPE]
    return row
