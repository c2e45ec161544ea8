"""Benchmark the omni_plugins.wire codec against pickle protocol 5, torch.save and raw bytes.

Every number is taken in the same run, methods interleaved round by round, and the
report is made of ratios against baselines measured alongside (the machine is noisy).

Methods (one "op" = encode + decode of a payload ``{"request_id", "step", "hidden": float32 tensor}``):

* ``memcpy``        -- ``dst.copy_(src)`` of the tensor into a pre-touched tensor (the physical baseline)
* ``wire_view``     -- ``encode`` + ``decode(arena)`` of a message already in an arena (zero copy)
* ``wire_view_pure`` -- the same on the pure-Python header path (``OMNI_WIRE_PURE=1``'s), for the
  compiled path's speed-up; when the extension is not built both are the pure-Python path
* ``wire_copy``     -- ``encode`` + ``write_into(pre-touched arena)`` + ``decode(arena, copy=True)``
* ``wire_bytes``    -- ``encode(...).to_bytes()`` + ``decode(copy=False)``
* ``numpy_bytes``   -- ``t.numpy().tobytes()`` + ``torch.frombuffer(b).clone()`` (tensor only)
* ``pickle5``       -- ``pickle.loads(pickle.dumps(payload, protocol=5))`` (in band)
* ``torch_save``    -- ``torch.save`` to BytesIO + ``torch.load(weights_only=True)``

Usage: ``python3 benchmarks/bench_codec.py [--quick] [--json FILE] [--plot FILE.png]``
"""

from __future__ import annotations

import argparse
import io
import os
import pickle  # baseline only: omni_plugins never imports pickle
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from tqdm import tqdm

from omni_plugins import wire
from omni_plugins.bench.runner import report, script_document
from omni_plugins.bench.schema import Column, Section, TargetResult
from omni_plugins.bench.targets import check
from omni_plugins.wire import _codec

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20, "256MiB": 256 << 20}
QUICK_SIZES = ("4KiB", "1MiB", "64MiB")
METHODS = ("memcpy", "wire_view", "wire_view_pure", "wire_copy", "wire_bytes", "numpy_bytes", "pickle5", "torch_save")

Op = Callable[[], Any]


def make_payload(nbytes: int) -> dict[str, Any]:
    return {"request_id": "req-0001", "step": 7, "hidden": torch.randn(nbytes // 4)}


def make_ops(payload: dict[str, Any]) -> dict[str, Op]:
    """One closure per method; all setup (arenas, destinations) happens here, untimed."""
    tensor = payload["hidden"]
    dst = torch.empty_like(tensor).fill_(1.0)  # pre-touched
    enc = wire.encode(payload)
    view_arena = bytearray(enc.nbytes)
    enc.write_into(view_arena)
    copy_arena = bytearray(b"\x01" * enc.nbytes)  # pre-touched

    def memcpy() -> Any:
        return dst.copy_(tensor)

    def wire_view() -> Any:
        wire.encode(payload)
        return wire.decode(view_arena)

    def wire_view_pure() -> Any:
        with _codec.use("python"):
            wire.encode(payload)
            return wire.decode(view_arena)

    def wire_copy() -> Any:
        wire.encode(payload).write_into(copy_arena)
        return wire.decode(copy_arena, copy=True)

    def wire_bytes() -> Any:
        return wire.decode(wire.encode(payload).to_bytes())

    def numpy_bytes() -> Any:
        data = tensor.numpy().tobytes()
        return torch.frombuffer(data, dtype=tensor.dtype).clone()

    def pickle5() -> Any:
        return pickle.loads(pickle.dumps(payload, protocol=5))

    def torch_save() -> Any:
        buf = io.BytesIO()
        torch.save(payload, buf)
        return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)

    ops = {name: fn for name, fn in locals().items() if name in METHODS}
    for name in METHODS[1:]:  # sanity: every method round-trips the tensor
        out = ops[name]()
        got = out if isinstance(out, torch.Tensor) else out["hidden"]
        if not torch.equal(got, tensor):
            raise AssertionError(f"{name} did not round-trip the payload")
    return ops


def calibrate(op: Op, budget_s: float) -> int:
    """Repetitions so that one timed sample lasts about ``budget_s``."""
    op()  # warm-up: first-touch page faults, lazy imports
    start = time.perf_counter()
    op()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(100_000, int(budget_s / once)))


def time_op(op: Op, reps: int) -> tuple[float, float]:
    """Seconds per op: (wall clock, CPU time of this process).

    CPU time is reported next to wall time because the benchmark machine is shared: when
    other processes compete for the cores, wall time includes time spent waiting for a
    core while CPU time does not (page-fault handling is kernel CPU time and is counted).
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        op()
    return (time.perf_counter() - wall0) / reps, (time.process_time() - cpu0) / reps


def run(sizes: list[str], rounds: int, budget_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    bar = tqdm(total=len(sizes) * rounds * len(METHODS), desc="bench_codec", unit="sample")
    for size_name in sizes:
        nbytes = SIZES[size_name]
        payload = make_payload(nbytes)
        ops = make_ops(payload)
        reps = {name: calibrate(op, budget_s) for name, op in ops.items()}
        walls: dict[str, list[float]] = {name: [] for name in METHODS}
        cpus: dict[str, list[float]] = {name: [] for name in METHODS}
        for _ in range(rounds):  # interleave methods round by round so drift hits all of them
            for name in METHODS:
                bar.set_postfix_str(f"{size_name} {name}")
                wall, cpu = time_op(ops[name], reps[name])
                walls[name].append(wall)
                cpus[name].append(cpu)
                bar.update()
        results[size_name] = {
            name: {
                "wall_median_s": statistics.median(walls[name]),
                "wall_min_s": min(walls[name]),
                "cpu_median_s": statistics.median(cpus[name]),
                "reps": reps[name],
                "gbps_wall": nbytes / statistics.median(walls[name]) / 1e9,
                "gbps_cpu": nbytes / max(statistics.median(cpus[name]), 1e-12) / 1e9,
            }
            for name in METHODS
        }
        del ops, payload
    bar.close()
    return results


def ratios(results: dict[str, Any], clock: str) -> dict[str, Any]:
    """Ratios between methods of the same size, from medians of ``clock`` ("wall" or "cpu")."""
    out: dict[str, Any] = {}
    for size_name, r in results.items():
        med = {name: max(v[f"{clock}_median_s"], 1e-12) for name, v in r.items()}
        out[size_name] = {
            "wire_view_over_memcpy": med["wire_view"] / med["memcpy"],
            "wire_view_speedup_vs_pure_python": med["wire_view_pure"] / med["wire_view"],
            "wire_copy_speedup_vs_numpy_bytes": med["numpy_bytes"] / med["wire_copy"],
            "wire_copy_speedup_vs_pickle5": med["pickle5"] / med["wire_copy"],
            "wire_copy_speedup_vs_torch_save": med["torch_save"] / med["wire_copy"],
            "wire_bytes_speedup_vs_pickle5": med["pickle5"] / med["wire_bytes"],
            "wire_copy_over_memcpy": med["wire_copy"] / med["memcpy"],
        }
    return out


def targets(results: dict[str, Any], rat: dict[str, Any]) -> list[TargetResult]:
    out: list[TargetResult] = []

    def add(description: str, op: Literal[">=", "<="], bound: float, value: float, at: str) -> None:
        out.append(check(section="codec", subject="wire", description=description, op=op, bound=bound, values=[(at, value)]))

    if "64MiB" in rat:
        r = rat["64MiB"]
        add("zero-copy encode + decode < 1% of one memcpy", "<=", 0.01, r["wire_view_over_memcpy"], "64MiB")
        add("encode + write_into + decode(copy) >= numpy tobytes/frombuffer", ">=", 1.0, r["wire_copy_speedup_vs_numpy_bytes"], "64MiB")
        add("encode + write_into + decode(copy) >= 4x pickle protocol 5", ">=", 4.0, r["wire_copy_speedup_vs_pickle5"], "64MiB")
    if "4KiB" in results:
        add("encode + decode <= 15 us", "<=", 15.0, results["4KiB"]["wire_view"]["wall_median_s"] * 1e6, "4KiB")
    return out


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(METHODS)
    for i, name in enumerate(METHODS):
        ax.bar([x + i * width for x in range(len(sizes))], [results[s][name]["gbps_wall"] for s in sizes], width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))], sizes)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (encode + decode, median)")
    ax.set_title("omni_plugins.wire vs baselines (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"sizes {', '.join(QUICK_SIZES)}, 3 rounds")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), help="override the sizes")
    parser.add_argument("--rounds", type=int, help="rounds per method (default 5, quick 3)")
    parser.add_argument("--budget", type=float, help="seconds per timed sample (default 0.2, quick 0.05)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: memcpy is one single-threaded copy)")
    parser.add_argument("--json", metavar="FILE", help="write results as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart (matplotlib, Agg)")
    args = parser.parse_args(argv)
    sizes = args.sizes or (list(QUICK_SIZES) if args.quick else list(SIZES))
    rounds = args.rounds or (3 if args.quick else 5)
    budget = args.budget or (0.05 if args.quick else 0.2)

    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # numpy_bytes baseline over bytes
    torch.set_num_threads(args.threads)
    results = run(sizes, rounds, budget)
    all_ratios = {clock: ratios(results, clock) for clock in ("wall", "cpu")}
    doc = script_document(args.quick)
    rows: list[dict[str, Any]] = []
    for size_name, per_method in results.items():
        for name, r in per_method.items():
            rows.append(
                {
                    "size": SIZES[size_name],
                    "method": name,
                    "gbps_wall": r["gbps_wall"],
                    "gbps_cpu": r["gbps_cpu"],
                    "wall_us": r["wall_median_s"] * 1e6,
                    "reps": r["reps"],
                }
            )
        rows += [
            {
                "size": SIZES[size_name],
                "method": f"ratio {key}",
                "ratio_wall": all_ratios["wall"][size_name][key],
                "ratio_cpu": all_ratios["cpu"][size_name][key],
            }
            for key in all_ratios["wall"][size_name]
        ]
    doc.sections["codec"] = Section(
        title="Wire codec against pickle, torch.save, raw bytes and one memcpy",
        about=__doc__.split("\n\n")[1].replace("\n", " ")
        + f" Implementation: {wire.IMPLEMENTATION}; {rounds} rounds, {budget} s per sample, {torch.get_num_threads()} torch thread(s).",
        columns=[
            Column(key="size", label="size", kind="size"),
            Column(key="method", label="method", kind="text"),
            Column(key="gbps_wall", label="GB/s", digits=3),
            Column(key="wall_us", label="us per op", digits=1),
            Column(key="ratio_wall", label="ratio (wall)", digits=3),
            Column(key="ratio_cpu", label="ratio (CPU)", digits=3),
        ],
        rows=rows,
    )
    doc.targets += targets(results, all_ratios["wall"])
    doc.machine.load_avg_end = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        doc.write(args.json)
    if args.plot:
        plot(results, args.plot)
    print(report(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
