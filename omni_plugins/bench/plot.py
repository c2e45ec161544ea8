"""``--plot``: one figure with a panel per section of a document (matplotlib, the ``plot`` extra).

Sizes: the connector's ratio to its raw baseline against payload size, per backend (dashed: the
floor, the best reachable). Load: hand-off p50 and delivered throughput against offered load,
the runtime next to the connector alone. Scaling: the runtime's CPU per chunk against streams.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from omni_plugins.bench.schema import BenchDocument, Section

#: how to get the extra the plot needs
INSTALL = "pip install 'omni-plugins[plot]'"


def missing_extra() -> str | None:
    """None when plotting can work here, else what to install (checked before a long run starts)."""
    if importlib.util.find_spec("matplotlib") is None:
        return f"--plot needs matplotlib, which is not installed: {INSTALL}"
    return None


def _series(section: Section, x: str, y: str, *group: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for row in section.rows:
        xv, yv = row.get(x), row.get(y)
        if not isinstance(xv, (int, float)) or not isinstance(yv, (int, float)):
            continue
        name = " ".join(str(row[g]) for g in group if row.get(g))
        xs, ys = out.setdefault(name, ([], []))
        xs.append(float(xv))
        ys.append(float(yv))
    return out


#: the sections a plot has a panel for
PLOTTED = ("sizes", "load", "scaling", "peer")


def plottable(doc: BenchDocument) -> bool:
    """Whether ``doc`` has a section the plot draws."""
    return any(name in doc.sections for name in PLOTTED)


def plot(doc: BenchDocument, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Any]] = []
    if "sizes" in doc.sections:
        panels.append(("sizes", _sizes))
    if "load" in doc.sections:
        panels += [("load", _load_latency), ("load", _load_throughput)]
    if "scaling" in doc.sections:
        panels.append(("scaling", _scaling))
    if "peer" in doc.sections:
        panels.append(("peer", _peer))
    if not panels:
        panels.append(("", None))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (name, draw) in zip(axes[0], panels, strict=True):
        if draw is None:
            ax.text(0.5, 0.5, "nothing measured", ha="center", va="center")
            continue
        draw(ax, doc.sections[name])
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("omni-plugins bench (same-run ratios, producer and consumer in separate processes)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(ax: Any, section: Section) -> None:
    ratios = _series(section, "size", "ratio", "backend", "variant")
    floors = _series(section, "size", "floor_ratio", "backend", "variant")
    for name, (xs, ys) in ratios.items():
        (line,) = ax.plot(xs, ys, "-", marker="o", label=name)
        if name in floors:
            ax.plot(*floors[name], "--", color=line.get_color(), lw=0.9, label=f"{name} floor")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("raw time / connector time (put + get)")
    ax.set_title("size curve", fontsize=9)


def _load_latency(ax: Any, section: Section) -> None:
    for name, (xs, ys) in _series(section, "offered_gbps", "p50_ms", "mode").items():
        ax.plot(xs, ys, "-", marker="o", label=f"{name} p50")
    for name, (xs, ys) in _series(section, "offered_gbps", "p99_ms", "mode").items():
        ax.plot(xs, ys, ":", marker=".", label=f"{name} p99")
    _log_axes(ax)
    ax.set_xlabel("offered GB/s")
    ax.set_ylabel("hand-off ms")
    ax.set_title("load curve: latency", fontsize=9)


def _load_throughput(ax: Any, section: Section) -> None:
    for name, (xs, ys) in _series(section, "offered_gbps", "delivered_gbps", "mode").items():
        ax.plot(xs, ys, "-", marker="o", label=name)
    offered = [float(v) for r in section.rows if isinstance(v := r.get("offered_gbps"), (int, float))]
    lo, hi = (min(offered), max(offered)) if offered else (0.01, 1.0)
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, label="offered")
    _log_axes(ax)
    ax.set_xlabel("offered GB/s")
    ax.set_ylabel("delivered GB/s")
    ax.set_title("load curve: throughput", fontsize=9)


def _scaling(ax: Any, section: Section) -> None:
    for key, label in (("runtime_cpu_us_per_chunk", "runtime"), ("connector_cpu_us_per_chunk", "connector alone")):
        for xs, ys in _series(section, "streams", key).values():
            ax.plot(xs, ys, "-", marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("CPU us per chunk (both stages)")
    ax.set_title("scaling", fontsize=9)


def _peer(ax: Any, section: Section) -> None:
    for name, (xs, ys) in _series(section, "size", "vs_peer", "what").items():
        ax.plot(xs, ys, "-", marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("peer time / ours")
    ax.set_title("vLLM-Omni in the same run", fontsize=9)


def _log_axes(ax: Any) -> None:
    """Log scales with plain tick labels (no crowded minor labels)."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
