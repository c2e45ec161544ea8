"""``omni-plugins bench``: every requested backend next to its raw baseline, one table, one JSON, one plot.

A backend is any registered connector whose plugin offers a raw baseline (services
``bench_config`` and ``raw_baseline``). Its private server, if its plugin has one, is started
here (loopback, a free port) unless the user gave the backend's config, and stopped at the end.
A backend whose plugin, binary or server is missing is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
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


def backends() -> list[str]:
    """Registered connectors whose plugins offer a raw baseline, by name (imports each plugin's services)."""
    from omni_plugins.services import offered, registered_services

    return sorted(name for name, services in registered_services().items() if "raw_baseline" in offered(services))


class Skip(Exception):
    """This backend cannot run here; the message says why."""


@dataclass
class BenchOptions:
    backends: list[str]
    sizes: list[int]
    quick: bool = False
    #: per backend, a config of the user's (a stage's ``extra``) laid over the plugin's bench config; no server is started for it
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
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
    """The backend's driver spec, its private server running (unless the user gave a config) and a scratch directory."""
    from omni_plugins.errors import OmniPluginsError
    from omni_plugins.services import RunScope, ServiceUnavailable, offered, require

    try:
        services = require(name, "raw_baseline")
    except OmniPluginsError as exc:
        raise Skip(str(exc)) from None
    user = opts.configs.get(name)
    scratch = Path(tempfile.mkdtemp(prefix="omni-bench-"))
    server = None
    try:
        if user is None and "start_server" in offered(services):
            try:
                server = services.start_server()
            except ServiceUnavailable as exc:
                raise Skip(f"{exc} (or give the backend's config: --config {name}=JSON)") from None
        config = {**services.bench_config(max_bytes, server, scratch), **(user or {})}
        yield DriverSpec(name, config, max_bytes)
        if "census" in offered(services):
            from omni_plugins.factory import validate_connector_config

            left = services.census(validate_connector_config(name, config), RunScope(uuid.uuid4().hex[:8]))
            if left.count:
                logger.warning("bench of %s left %s", name, left.census_line())
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


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
