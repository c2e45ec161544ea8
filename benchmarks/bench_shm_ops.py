"""In-process CPU cost of the ``shm`` connector's bookkeeping: ``put``/``get`` and ``wait_any``.

The machine is shared, so every figure is CPU time (``time.thread_time``), best of N
repetitions, and ratios are against a baseline measured in the same run:

- ``floor``: two ``os.rename`` calls in the shm directory (publish + claim): the syscall floor of
  one payload's trip, without codec or connector.
- ``put_get``: ``put`` then ``get`` of a 4 KiB tensor, one payload in flight.
- ``put_get_ttl``: ``put_get`` with ``ttl_seconds=60`` on the producer (the cost of the expiry records).
- ``put_get_64``: 64 payloads in flight (64 puts, then 64 gets in a shuffled order), per payload.
- ``put_outstanding``: one ``put`` while ``--outstanding`` (default 2,000) earlier payloads of the
  same size class are still unconsumed (the pool must not scan them all).
- ``wait_any_64``: ``wait_any`` over the same 64 keys, one of them present (timeout 0).
- ``wait_any_1024_list_slots`` / ``wait_any_1024_set_slots`` (slot table): ``wait_any`` over 1,024
  keys with 16 of them present, passed as a list (each key looked for) and as a dict's keys view (each
  READY slot's key looked up in it), as a receive thread waiting on a thousand streams calls it.

Also reports ``looks_free`` calls per put (pool probes) for the in-flight modes.

    python benchmarks/bench_shm_ops.py [--quick] [--json FILE] [--plot FILE.png]

Before/after a change: run it against an older tree with ``PYTHONPATH=<old>/plugins/shm``
(e.g. from ``git archive <rev> plugins/shm``), alternating with the current one.
"""

from __future__ import annotations

import argparse
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from omni_plugins_shm.config import ShmConfig
from omni_plugins_shm.segments import pool as pool_mod
from tqdm import tqdm

from omni_plugins import create_connector
from omni_plugins.bench.runner import report, script_document
from omni_plugins.bench.schema import Column, Section


def _best(fn: Callable[[], int], reps: int) -> float:
    """Best CPU seconds per operation over ``reps`` runs of ``fn`` (which returns its op count)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        n = fn()
        best = min(best, (time.thread_time() - t0) / n)
    return best


class _ProbeCounter:
    """Counts ``Segment.looks_free`` calls (pool probes) while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = pool_mod.Segment.looks_free

    def __enter__(self) -> _ProbeCounter:
        orig = self._orig

        def counted(seg: pool_mod.Segment) -> bool:
            self.calls += 1
            return orig(seg)

        pool_mod.Segment.looks_free = counted  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        pool_mod.Segment.looks_free = self._orig  # type: ignore[method-assign]


def run(quick: bool, outstanding: int) -> dict[str, Any]:
    reps = 5 if quick else 9
    n = 300 if quick else 1000
    ns = f"bops{uuid.uuid4().hex[:8]}"
    payload = {"t": torch.arange(1024, dtype=torch.float32)}
    keys64 = [f"w{i}" for i in range(64)]
    results: dict[str, float] = {}
    probes: dict[str, float] = {}
    bar = tqdm(total=7, desc="bench_shm_ops", unit="mode")
    with create_connector("shm", {"namespace": ns}) as conn:
        base = f"/dev/shm/bops-floor-{ns}"
        open(base, "wb").close()

        def floor() -> int:
            for _ in range(n):
                os.rename(base, base + ".k")
                os.rename(base + ".k", base)
            return n

        results["floor"] = _best(floor, reps)
        os.unlink(base)
        bar.update()

        def put_get(producer: Any = conn, tag: str = "a") -> int:
            for i in range(n):
                producer.put(0, 1, f"{tag}{i}", payload)
                conn.get(0, 1, f"{tag}{i}")
            return n

        put_get()
        with _ProbeCounter() as pc:
            results["put_get"] = _best(put_get, reps)
        probes["put_get"] = pc.calls / (n * reps)
        bar.update()

        if "slot_count" in ShmConfig.model_fields:  # the slot table (small payloads without file syscalls)
            with create_connector("shm", {"namespace": ns, "slot_count": 256}) as slot_conn:

                def slot_put_get() -> int:
                    for i in range(n):
                        slot_conn.put(0, 1, f"s{i}", payload)
                        slot_conn.get(0, 1, f"s{i}")
                    return n

                def slot_wait_any() -> int:
                    for _ in range(n):
                        slot_conn.wait_any(keys64, 0.0)
                    return n

                slot_put_get()
                results["put_get_slots"] = _best(slot_put_get, reps)
                slot_conn.put(0, 1, keys64[17], payload)
                results["wait_any_64_slots"] = _best(slot_wait_any, reps)
                slot_conn.cleanup(keys64[17])
                if slot_conn.capabilities.wait_any_sets:
                    many = {f"stream{i}-req0_0_{i % 32}": None for i in range(1024)}
                    present = list(many)[::64]
                    for key in present:
                        slot_conn.put(0, 1, key, payload)
                    for label, waited in (("list", lambda: list(many)), ("set", many.keys)):

                        def wait_many(waited: Callable[[], Any] = waited) -> int:
                            for _ in range(n):
                                slot_conn.wait_any(waited(), 0.0)
                            return n

                        wait_many()
                        results[f"wait_any_1024_{label}_slots"] = _best(wait_many, reps)
                    for key in present:
                        slot_conn.cleanup(key)
        bar.update()

        if "ttl_seconds" in ShmConfig.model_fields:  # absent in older versions (before/after runs)
            with create_connector("shm", {"namespace": ns, "ttl_seconds": 60.0}) as ttl_conn:
                put_get(ttl_conn, "t")
                results["put_get_ttl"] = _best(lambda: put_get(ttl_conn, "t"), reps)
        bar.update()

        rng = random.Random(7)

        def put_get_64() -> int:
            rounds = max(1, n // 64)
            for r in range(rounds):
                ks = [f"b{r}-{i}" for i in range(64)]
                for k in ks:
                    conn.put(0, 1, k, payload)
                rng.shuffle(ks)
                for k in ks:
                    conn.get(0, 1, k)
            return rounds * 64

        put_get_64()
        with _ProbeCounter() as pc:
            results["put_get_64"] = _best(put_get_64, reps)
        probes["put_get_64"] = pc.calls / (max(1, n // 64) * 64 * reps)
        bar.update()

        for i in range(outstanding):
            conn.put(0, 1, f"o{i}", payload)
        m = 50 if quick else 200
        counter = iter(range(10**9))

        def put_outstanding() -> int:
            ks = [f"x{next(counter)}" for _ in range(m)]
            t0 = time.thread_time()
            for k in ks:
                conn.put(0, 1, k, payload)
            spent = time.thread_time() - t0
            for k in ks:
                conn.get(0, 1, k)
            nonlocal_spent.append(spent)
            return m

        nonlocal_spent: list[float] = []
        with _ProbeCounter() as pc:
            for _ in range(reps):
                put_outstanding()
        results["put_outstanding"] = min(nonlocal_spent) / m
        probes["put_outstanding"] = pc.calls / (m * reps)
        for i in range(outstanding):
            conn.cleanup(f"o{i}")
        bar.update()

        conn.put(0, 1, keys64[17], payload)
        waits = n * 2

        def wait_any() -> int:
            for _ in range(waits):
                conn.wait_any(keys64, 0.0)
            return waits

        wait_any()
        results["wait_any_64"] = _best(wait_any, reps)
        conn.cleanup(keys64[17])
        bar.update()
    bar.close()
    us = {k: round(v * 1e6, 2) for k, v in results.items()}
    ratios = {k: round(v / results["floor"], 2) for k, v in results.items() if k != "floor"}
    return {"cpu_us_per_op": us, "ratio_vs_floor": ratios, "looks_free_per_put": probes, "outstanding": outstanding, "quick": quick}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--outstanding", type=int, default=2000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    out = run(args.quick, args.outstanding)
    doc = script_document(args.quick)
    rows = [{"op": "floor", "cpu_us": out["cpu_us_per_op"]["floor"], "vs_floor": 1.0}]
    rows += [
        {"op": op, "cpu_us": us, "vs_floor": out["ratio_vs_floor"][op], "looks_free_per_put": out["looks_free_per_put"].get(op)}
        for op, us in out["cpu_us_per_op"].items()
        if op != "floor"
    ]
    doc.sections["shm_ops"] = Section(
        title="shm bookkeeping, CPU per operation",
        about=__doc__.split("\n\n")[1].replace("\n", " ") + f" {args.outstanding} payloads outstanding for put_outstanding.",
        columns=[
            Column(key="op", label="operation", kind="text"),
            Column(key="cpu_us", label="CPU us", digits=2),
            Column(key="vs_floor", label="vs two renames"),
            Column(key="looks_free_per_put", label="pool probes per put"),
        ],
        rows=rows,
    )
    doc.machine.load_avg_end = [round(x, 2) for x in os.getloadavg()]
    print(report(doc))
    if args.json:
        doc.write(args.json)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        names = list(out["ratio_vs_floor"])
        ax.barh(names, [out["ratio_vs_floor"][k] for k in names])
        ax.set_xlabel("CPU time per op / two renames (floor)")
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
