"""Benchmark: the Redis connector against raw redis-py ``SET``/``GET`` of the same bytes, same run.

For each size a private ``redis-server`` (loopback, no persistence) receives,
alternately, the connector's ``put``/``get`` of ``{"x": <uint8 tensor>}`` and
redis-py's ``SET``/``GET`` of a ``bytes`` object of the same size. Each number
is the median over rounds (``best_*``: the fastest round, less sensitive to a
busy machine); ratios are baseline time / connector time (higher
is better for the connector).

Targets (issue 6): at 64 MiB put >= 5x raw SET and get >= 2x raw GET; at
4 KiB a get round trip within 1.2x of a raw GET round trip.

    python3 benchmarks/bench_redis.py --json results/redis.json [--quick] [--plot redis.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch
from omni_plugins_redis.testing import RedisServer
from tqdm import tqdm

from omni_plugins import create_connector

KIB, MIB = 1024, 1024 * 1024
FULL_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
QUICK_SIZES = [4 * KIB, 1 * MIB, 64 * MIB]


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    for suffix, mult in (("kib", KIB), ("mib", MIB), ("k", KIB), ("m", MIB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def _label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def bench_size(conn: Any, raw: Any, size: int, rounds: int) -> dict[str, Any]:
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
    payload = {"x": tensor}
    blob = tensor.numpy().tobytes()
    repeat = max(1, min(200, (4 * MIB) // size))  # small sizes: many calls per sample
    samples: dict[str, list[float]] = {"put": [], "get": [], "set": [], "raw_get": []}
    got_size = 0
    for _ in range(rounds):
        # Connector put+get and raw SET+GET alternate call by call (which side goes first
        # alternates too), so a load swing on the shared machine hits both sides alike.
        acc = dict.fromkeys(samples, 0.0)
        for i in range(repeat):
            for side in (0, 1) if i % 2 == 0 else (1, 0):
                if side == 0:  # connector: put then get, same key each time (each get consumes)
                    t0 = time.perf_counter()
                    conn.put(0, 1, "bench", payload)
                    t1 = time.perf_counter()
                    res = conn.get(0, 1, "bench")
                    t2 = time.perf_counter()
                    assert res is not None and res.data["x"].numel() == size
                    got_size = res.size
                    del res
                    acc["put"] += t1 - t0
                    acc["get"] += t2 - t1
                else:  # baseline: raw redis-py SET then GET of the same bytes
                    t0 = time.perf_counter()
                    raw.set("bench:raw", blob)
                    t1 = time.perf_counter()
                    value = raw.get("bench:raw")
                    t2 = time.perf_counter()
                    assert value is not None and len(value) == size
                    del value
                    acc["set"] += t1 - t0
                    acc["raw_get"] += t2 - t1
        raw.delete("bench:raw")
        for name, total in acc.items():
            samples[name].append(total / repeat)
    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: min(v) for k, v in samples.items()}
    return {
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--sizes", help="comma-separated sizes, e.g. 4KiB,1MiB,64MiB")
    parser.add_argument("--rounds", type=int, help="samples per size (median reported)")
    parser.add_argument("--json", dest="json_path", help="write results here")
    parser.add_argument("--plot", help="write a PNG of the ratios here")
    parser.add_argument("--chunk-bytes", type=_parse_size, default=4 * MIB)
    parser.add_argument("--read-window", type=int, default=2)
    args = parser.parse_args(argv)

    sizes = [_parse_size(s) for s in args.sizes.split(",")] if args.sizes else (QUICK_SIZES if args.quick else FULL_SIZES)
    rounds = args.rounds or (5 if args.quick else 7)
    results: list[dict[str, Any]] = []
    with RedisServer() as server:
        raw = server.client(socket_timeout=120)
        config = server.connector_config(
            key_prefix="bench:", chunk_bytes=args.chunk_bytes, read_window=args.read_window, socket_timeout=120
        )
        with create_connector("redis", config) as conn:
            for size in tqdm(sizes, desc="redis bench", unit="size"):
                results.append(bench_size(conn, raw, size, rounds))
        raw.close()

    by_size = {r["size"]: r for r in results}
    targets: dict[str, Any] = {}
    if 64 * MIB in by_size:
        r = by_size[64 * MIB]
        targets["put_64MiB_vs_raw_set>=5"] = {"value": round(r["put_vs_raw_set"], 2), "ok": r["put_vs_raw_set"] >= 5}
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
    for name, t in targets.items():
        print(f"target {name}: {t['value']} {'OK' if t['ok'] else 'MISSED'}")
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
