"""``omni-plugins bench``: every requested backend next to its raw baseline, one table, one JSON, one plot.

Servers are started here (loopback, free ports, via the plugins' ``testing``
launchers) unless an address is given, and stopped at the end. A backend
whose plugin, binary or server is missing is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_plugins.bench.drivers import DriverSpec

logger = logging.getLogger(__name__)

BACKENDS = ("shm", "redis", "mooncake-store", "mooncake-te")
PLUGIN_OF = {
    "shm": "omni_plugins_shm",
    "redis": "omni_plugins_redis",
    "mooncake-store": "omni_plugins_mooncake",
    "mooncake-te": "omni_plugins_mooncake",
}


class Skip(Exception):
    """This backend cannot run here; the message says why."""


@dataclass
class BenchOptions:
    backends: list[str]
    sizes: list[int]
    quick: bool = False
    redis_url: str | None = None
    mooncake_master: str | None = None
    progress: bool = True


@dataclass
class BenchResult:
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "command": self.command, "results": self.results, "skipped": self.skipped}

    def table(self) -> str:
        head = ("BACKEND", "SIZE", "RAW GB/s", "OMNI GB/s", "RATIO", "RAW p50 ms", "OMNI p50 ms", "OPS")
        rows = [head]
        for backend, per_size in self.results.items():
            for r in per_size:
                rows.append(
                    (
                        backend,
                        format_size(r["size"]),
                        f"{r['raw_gbps']:.3f}",
                        f"{r['omni_gbps']:.3f}",
                        f"{r['ratio']:.2f}",
                        f"{r['raw_p50_ms']:.3f}",
                        f"{r['omni_p50_ms']:.3f}",
                        str(r["ops"]),
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
        lines += [f"skipped {b}: {why}" for b, why in self.skipped.items()]
        lines.append("RATIO = omni throughput / raw throughput on the same backend, same run (1.00 = as fast as raw).")
        return "\n".join(lines)


_UNITS = {
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
}


def parse_size(text: str) -> int:
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :] or "b"
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 4KiB, 1MiB, 64MiB)")
    return int(float(num) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    info["cpus"] = os.cpu_count()
    with contextlib.suppress(OSError):
        info["load_avg"] = os.getloadavg()
    with contextlib.suppress(Exception):
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / (1 << 30), 1)
    return info


@contextlib.contextmanager
def _backend(name: str, opts: BenchOptions, max_bytes: int) -> Iterator[DriverSpec]:
    try:
        __import__(PLUGIN_OF[name])
    except ImportError:
        raise Skip(f"plugin not installed (pip install {PLUGIN_OF[name].replace('_', '-')})") from None
    if name == "shm":
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        yield DriverSpec(name, "shm", {"namespace": ns, "pool_bytes": 2 * max_bytes + (8 << 20)}, max_bytes)
        from omni_plugins_shm.testing import namespace_segments  # type: ignore[import-not-found]

        left = namespace_segments(ns)
        if left:
            logger.warning("shm bench left %d segment(s) in namespace %s", len(left), ns)
    elif name == "redis":
        if opts.redis_url:
            yield DriverSpec(name, "redis", {"url": opts.redis_url, "key_prefix": "omnibench:"}, max_bytes, {"url": opts.redis_url})
            return
        from omni_plugins_redis.testing import RedisServer  # type: ignore[import-not-found]

        if shutil.which("redis-server") is None:
            raise Skip("redis-server not found (Debian: apt-get install redis-server), and no --redis-url given")
        password = secrets.token_hex(12)
        with RedisServer(password=password, extra_args=["--proto-max-bulk-len", str(max(512 << 20, 2 * max_bytes))]) as server:
            url = f"redis://:{password}@127.0.0.1:{server.port}/0"
            yield DriverSpec(name, "redis", {"url": url, "key_prefix": "omnibench:"}, max_bytes, {"url": url})
            left_keys = server.keys("*")
            if left_keys:
                logger.warning("redis bench left %d key(s)", len(left_keys))
    else:
        from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment  # type: ignore[import-not-found]

        loopback_environment()
        if name == "mooncake-te":
            rdv = tempfile.mkdtemp(prefix="omni-bench-rdv-")
            try:
                cfg = {"rendezvous_dir": rdv, "pool_size": 4 * max_bytes + (64 << 20)}
                yield DriverSpec(name, "mooncake-te", cfg, max_bytes)
            finally:
                shutil.rmtree(rdv, ignore_errors=True)
            return
        seg = 4 * max_bytes + (64 << 20)
        if opts.mooncake_master:
            cfg = {"master_address": opts.mooncake_master, "global_segment_size": seg}
            yield DriverSpec(name, "mooncake-store", cfg, max_bytes, {"master": opts.mooncake_master})
            return
        try:
            master = MooncakeMaster().start()
        except RuntimeError as exc:
            raise Skip(str(exc)) from None
        try:
            cfg = {"master_address": master.address, "global_segment_size": seg}
            yield DriverSpec(name, "mooncake-store", cfg, max_bytes, {"master": master.address})
        finally:
            master.stop()


def run_bench(opts: BenchOptions) -> BenchResult:
    from tqdm import tqdm

    from omni_plugins.bench.harness import ROUNDS, iterations, measure

    result = BenchResult(machine=machine())
    total = sum(2 * (iterations(s, opts.quick)[1] // ROUNDS) * ROUNDS for s in opts.sizes) * len(opts.backends)
    max_bytes = max(opts.sizes)
    with tqdm(total=total, desc="bench", unit="op", disable=not opts.progress, leave=False) as bar:
        for name in opts.backends:
            bar.set_postfix_str(name)
            started = time.monotonic()
            try:
                with _backend(name, opts, max_bytes) as spec:
                    result.results[name] = measure(spec, opts.sizes, opts.quick, tick=bar.update)
            except Skip as exc:
                result.skipped[name] = str(exc)
            except Exception as exc:
                logger.debug("bench of %s failed", name, exc_info=True)
                result.skipped[name] = f"failed: {type(exc).__name__}: {exc}"
            logger.info("%s took %.1fs", name, time.monotonic() - started)
    return result


def write_json(result: BenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")


def plot(result: BenchResult, path: str | Path) -> None:
    """Throughput per size (raw dashed, omni solid) and the ratio, one colour per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (backend, rows) in enumerate(result.results.items()):
        color = f"C{i}"
        xs = [r["size"] for r in rows]
        ax1.plot(xs, [r["raw_gbps"] for r in rows], "--", color=color, marker="o", label=f"{backend} raw")
        ax1.plot(xs, [r["omni_gbps"] for r in rows], "-", color=color, marker="s", label=f"{backend} omni")
        ax2.plot(xs, [r["ratio"] for r in rows], "-", color=color, marker="s", label=backend)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload bytes")
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("put+get GB/s (cross-process)")
    ax1.legend(fontsize=7)
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_ylabel("omni / raw throughput")
    ax2.legend(fontsize=7)
    fig.suptitle("omni-plugins bench: connectors vs raw backend baselines (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
