"""Benchmark: the Redis connector against raw redis-py ``SET``/``GET`` of the same bytes, same run.

For each size a private ``redis-server`` (loopback, no persistence) receives,
alternately, the connector's ``put``/``get`` of ``{"x": <uint8 tensor>}`` and
redis-py's ``SET``/``GET`` of a ``bytes`` object of the same size. Each number
is the median over rounds (``best_*``: the fastest round, less sensitive to a
busy machine); ratios are baseline time / connector time (higher
is better for the connector).

Targets: at 64 MiB put >= 5x raw SET and get >= 2x raw GET; at
4 KiB a get round trip within 1.2x of a raw GET round trip.

From 16 MiB on, same-run evidence is added (it changes no baseline or
target): the redis-server's CPU per call; with ``--floor`` also a *minimal
parted writer*: the same bytes written as ``chunk_bytes`` parts with
hand-framed pipelined ``SET``s on a raw socket, interleaved with the other
calls (no codec, no transaction, no manifest; its parts are deleted right
after, so unlike the connector it gets no reuse of server memory).

    python3 benchmarks/bench_redis.py --json results/redis.json [--quick] [--plot redis.png]
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import socket
import statistics
import time
from typing import Any

import torch
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.packing import Buffer, pack_many
from omni_plugins_redis.replies import ReplyReader
from omni_plugins_redis.testing import RedisServer
from tqdm import tqdm

from omni_plugins import create_connector

KIB, MIB = 1024, 1024 * 1024
FULL_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
QUICK_SIZES = [4 * KIB, 1 * MIB, 64 * MIB]
# Sizes at which the server's CPU per call (and, with --floor, a minimal parted writer) are measured too.
PROBE_MIN_SIZE = 16 * MIB


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, mult in (("kib", KIB), ("mib", MIB), ("k", KIB), ("m", MIB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def _label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


class ServerProbe:
    """Same-run evidence for large sizes: the server's CPU per call and a minimal parted writer.

    ``cpu()`` reads the redis-server's CPU time (all threads, ns resolution from
    ``/proc/<pid>/task/*/schedstat``). ``floor_put()`` writes the same bytes as
    ``chunk``-sized parts with hand-framed, pipelined ``SET ... PX`` on a raw
    socket (no codec, no transaction, no manifest), deleted right after: what a
    client pays that writes parts and gets no reuse of the server's memory.
    """

    def __init__(self, server: RedisServer, chunk: int) -> None:
        self.pid = server.process.pid if server.process is not None else 0
        self.chunk = chunk
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = ReplyReader(self.sock, self.sock.settimeout, 120.0)

    def cpu(self) -> float:
        total = 0
        for path in glob.glob(f"/proc/{self.pid}/task/*/schedstat"):
            with open(path) as fh:
                total += int(fh.read().split()[0])
        return total / 1e9

    def cpus(self) -> tuple[float, float]:
        """(redis-server CPU seconds, this thread's CPU seconds)."""
        return self.cpu(), time.thread_time()

    def floor_put(self, data: memoryview) -> list[bytes]:
        """Write ``data`` as parts; returns their keys (for :meth:`drop`, outside the timed call)."""
        keys = [b"bench:floor:%d" % i for i in range(-(-data.nbytes // self.chunk))]
        chunk = self.chunk
        self._send(pack_many([("SET", k, data[i * chunk : (i + 1) * chunk], "PX", 600_000) for i, k in enumerate(keys)]))
        replies = [self.reader.reply() for _ in keys]
        assert all(r == "OK" for r in replies), replies
        return keys

    def _send(self, frames: list[Buffer]) -> None:
        for frame in frames:  # large values are views of ``data``: the kernel copies them, Python does not
            self.sock.sendall(frame)

    def drop(self, keys: list[bytes]) -> None:
        self._send(pack_many([("UNLINK", *keys)]))
        self.reader.reply()

    def close(self) -> None:
        self.sock.close()


def _no_cpus() -> tuple[float, float]:
    return 0.0, 0.0


def _add(server: dict[str, float], client: dict[str, float], name: str, before: tuple[float, float], after: tuple[float, float]) -> None:
    server[name] += after[0] - before[0]
    client[name] += after[1] - before[1]


def bench_size(conn: Any, raw: Any, size: int, rounds: int, probe: ServerProbe | None = None, floor: bool = False) -> dict[str, Any]:
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
    payload = {"x": tensor}
    blob = tensor.numpy().tobytes()
    repeat = max(1, min(200, (4 * MIB) // size))  # small sizes: many calls per sample
    probe = probe if size >= PROBE_MIN_SIZE else None
    samples: dict[str, list[float]] = {"put": [], "get": [], "set": [], "raw_get": []}
    floor = floor and probe is not None
    if floor:
        samples["floor_put"] = []
    server_cpu: dict[str, list[float]] = {k: [] for k in samples}
    sides = (0, 1, 2) if floor else (0, 1)
    got_size = 0
    # large sizes: (redis-server CPU, this thread's CPU incl. its system calls) around each call
    cpu = probe.cpus if probe is not None else _no_cpus
    client_cpu: dict[str, list[float]] = {k: [] for k in samples}
    for _ in range(rounds):
        # Connector put+get and raw SET+GET alternate call by call (which side goes first
        # alternates too), so a load swing on the shared machine hits both sides alike.
        acc = dict.fromkeys(samples, 0.0)
        acc_cpu = dict.fromkeys(samples, 0.0)
        acc_client = dict.fromkeys(samples, 0.0)
        for i in range(repeat):
            for side in sides if i % 2 == 0 else sides[::-1]:
                if side == 0:  # connector: put then get, same key each time (each get consumes)
                    c0 = cpu()
                    t0 = time.perf_counter()
                    conn.put(0, 1, "bench", payload)
                    t1 = time.perf_counter()
                    c1 = cpu()
                    res = conn.get(0, 1, "bench")
                    t2 = time.perf_counter()
                    c2 = cpu()
                    assert res is not None and res.data["x"].numel() == size
                    got_size = res.size
                    del res
                    acc["put"] += t1 - t0
                    acc["get"] += t2 - t1
                    _add(acc_cpu, acc_client, "put", c0, c1)
                    _add(acc_cpu, acc_client, "get", c1, c2)
                elif side == 1:  # baseline: raw redis-py SET then GET of the same bytes
                    c0 = cpu()
                    t0 = time.perf_counter()
                    raw.set("bench:raw", blob)
                    t1 = time.perf_counter()
                    c1 = cpu()
                    value = raw.get("bench:raw")
                    t2 = time.perf_counter()
                    c2 = cpu()
                    assert value is not None and len(value) == size
                    del value
                    acc["set"] += t1 - t0
                    acc["raw_get"] += t2 - t1
                    _add(acc_cpu, acc_client, "set", c0, c1)
                    _add(acc_cpu, acc_client, "raw_get", c1, c2)
                elif probe is not None:  # evidence: a minimal parted writer for these bytes
                    c0 = cpu()
                    t0 = time.perf_counter()
                    parts = probe.floor_put(memoryview(blob))
                    t1 = time.perf_counter()
                    acc["floor_put"] += t1 - t0
                    _add(acc_cpu, acc_client, "floor_put", c0, cpu())
                    probe.drop(parts)  # like the connector's get, frees the parts (not timed)
        raw.delete("bench:raw")
        for name, total in acc.items():
            samples[name].append(total / repeat)
            server_cpu[name].append(acc_cpu[name] / repeat)
            client_cpu[name].append(acc_client[name] / repeat)
    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: min(v) for k, v in samples.items()}
    result = {
        "size": size,
        "label": _label(size),
        "wire_bytes": got_size,
        "rounds": rounds,
        "calls_per_round": repeat,
        "seconds": med,
        "best_seconds": best,
        "best_put_vs_raw_set": best["set"] / best["put"],
        "best_get_vs_raw_get": best["raw_get"] / best["get"],
        "best_get_latency_vs_raw_get": best["get"] / best["raw_get"],
        "gbps": {k: size / v / 1e9 for k, v in med.items()},
        "put_vs_raw_set": med["set"] / med["put"],
        "get_vs_raw_get": med["raw_get"] / med["get"],
        "roundtrip_vs_raw": (med["put"] + med["get"]) / (med["set"] + med["raw_get"]),
        "get_latency_vs_raw_get": med["get"] / med["raw_get"],
    }
    if probe is not None:
        result["server_cpu_seconds"] = {k: statistics.median(v) for k, v in server_cpu.items()}
        result["client_cpu_seconds"] = {k: statistics.median(v) for k, v in client_cpu.items()}
        # the same ratio in CPU time (client + server), which a loaded machine's scheduling does not bend
        both = {k: statistics.median(server_cpu[k]) + statistics.median(client_cpu[k]) for k in samples}
        result["cpu_put_vs_raw_set"] = both["set"] / both["put"]
        result["cpu_get_vs_raw_get"] = both["raw_get"] / both["get"]
    if floor:
        # what a minimal parted writer reaches against this server now, and how close the put comes
        result["floor_put_vs_raw_set"] = med["set"] / med["floor_put"]
        result["put_vs_floor"] = med["put"] / med["floor_put"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--sizes", help="comma-separated sizes, e.g. 4KiB,1MiB,64MiB")
    parser.add_argument("--rounds", type=int, help="samples per size (median reported)")
    parser.add_argument("--json", dest="json_path", help="write results here")
    parser.add_argument("--plot", help="write a PNG of the ratios here")
    parser.add_argument("--chunk-bytes", type=_parse_size, default=RedisConfig.model_fields["chunk_bytes"].default)
    parser.add_argument("--read-window", type=int, default=2)
    parser.add_argument(
        "--floor", action="store_true", help="from 16 MiB, also time a minimal parted writer (raw socket, parts deleted at once)"
    )
    args = parser.parse_args(argv)

    sizes = [_parse_size(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if args.quick else FULL_SIZES)
    rounds = args.rounds or (5 if args.quick else 7)
    results: list[dict[str, Any]] = []
    with RedisServer() as server:
        raw = server.client(socket_timeout=120)
        config = server.connector_config(
            key_prefix="bench:", chunk_bytes=args.chunk_bytes, read_window=args.read_window, socket_timeout=120
        )
        probe = ServerProbe(server, args.chunk_bytes)
        with create_connector("redis", config) as conn:
            for size in tqdm(sizes, desc="redis bench", unit="size"):
                results.append(bench_size(conn, raw, size, rounds, probe, args.floor))
        probe.close()
        raw.close()

    by_size = {r["size"]: r for r in results}
    targets: dict[str, Any] = {}
    if 64 * MIB in by_size:
        r = by_size[64 * MIB]
        targets["put_64MiB_vs_raw_set>=5"] = {"value": round(r["put_vs_raw_set"], 2), "ok": r["put_vs_raw_set"] >= 5}
        if "floor_put_vs_raw_set" in r:
            # same-run evidence: what a minimal parted writer (no codec, no transaction) reaches against this server
            targets["put_64MiB_vs_raw_set>=5"]["floor_put_vs_raw_set"] = round(r["floor_put_vs_raw_set"], 2)
            targets["put_64MiB_vs_raw_set>=5"]["put_vs_floor"] = round(r["put_vs_floor"], 2)
        targets["get_64MiB_vs_raw_get>=2"] = {"value": round(r["get_vs_raw_get"], 2), "ok": r["get_vs_raw_get"] >= 2}
    if 4 * KIB in by_size:
        r = by_size[4 * KIB]
        targets["get_4KiB_latency_vs_raw_get<=1.2"] = {
            "value": round(r["get_latency_vs_raw_get"], 3),
            "ok": r["get_latency_vs_raw_get"] <= 1.2,
        }
        targets["roundtrip_4KiB_vs_raw_set_get<=1.2"] = {"value": round(r["roundtrip_vs_raw"], 3), "ok": r["roundtrip_vs_raw"] <= 1.2}
    report = {
        "benchmark": "redis",
        "baseline": "redis-py SET/GET (hiredis) of the same bytes, same server, same run",
        "machine": {"python": platform.python_version(), "cpus": torch.get_num_threads(), "platform": platform.platform()},
        "config": {"chunk_bytes": args.chunk_bytes, "read_window": args.read_window, "rounds": rounds},
        "results": results,
        "targets": targets,
    }
    for r in results:
        print(
            f"{r['label']:>8}: put {r['gbps']['put']:.2f} GB/s ({r['put_vs_raw_set']:.2f}x SET)  "
            f"get {r['gbps']['get']:.2f} GB/s ({r['get_vs_raw_get']:.2f}x GET)  "
            f"get latency {r['seconds']['get'] * 1e6:.0f} us vs GET {r['seconds']['raw_get'] * 1e6:.0f} us"
        )
        if "server_cpu_seconds" in r:
            cpu = r["server_cpu_seconds"]
            ccpu = r["client_cpu_seconds"]
            line = (
                f"{'':>8}  CPU per call, server + client: put {cpu['put'] * 1e3:.1f} + {ccpu['put'] * 1e3:.1f} ms, "
                f"SET {cpu['set'] * 1e3:.1f} + {ccpu['set'] * 1e3:.1f} ms ({r['cpu_put_vs_raw_set']:.2f}x); "
                f"get {cpu['get'] * 1e3:.1f} + {ccpu['get'] * 1e3:.1f} ms, GET {cpu['raw_get'] * 1e3:.1f} + {ccpu['raw_get'] * 1e3:.1f} ms "
                f"({r['cpu_get_vs_raw_get']:.2f}x)"
            )
            if "floor_put" in cpu:
                line += (
                    f"; minimal parted writer {cpu['floor_put'] * 1e3:.1f} ms, {r['gbps']['floor_put']:.2f} GB/s "
                    f"({r['floor_put_vs_raw_set']:.2f}x SET; put takes {r['put_vs_floor']:.2f}x its time)"
                )
            print(line)
    for name, t in targets.items():
        extra = f" (minimal parted writer, same run: {t['floor_put_vs_raw_set']}x)" if "floor_put_vs_raw_set" in t else ""
        print(f"target {name}: {t['value']} {'OK' if t['ok'] else 'MISSED'}{extra}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(report, fh, indent=2)
    if args.plot:
        _plot(results, args.plot)
    return 0


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(labels, [r["put_vs_raw_set"] for r in results], marker="o", label="put / raw SET")
    ax.plot(labels, [r["get_vs_raw_get"] for r in results], marker="o", label="get / raw GET")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speed-up over redis-py (x)")
    ax.set_title("omni-plugins redis connector vs raw redis-py")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
