"""The performance page's measurements: ``benchmarks/results/*.json`` as tables and a plot.

The only source of the numbers the docs quote. A results file of ``omni-plugins bench --json``
(``{"machine", "command", "results": {backend: [row per size]}, "skipped"}``) becomes a table and
the plot; any other JSON file is listed with its command and machine and its ``ratios`` and
``figures`` (absolute measures), if it has them. Nothing here measures anything.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def load() -> list[tuple[str, dict[str, Any]]]:
    """``(file name, content)`` of every results file, sorted by name."""
    return [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(RESULTS_DIR.glob("*.json"))]


def is_bench(data: dict[str, Any]) -> bool:
    """True for the output of ``omni-plugins bench --json``."""
    return isinstance(data.get("results"), dict) and all(isinstance(rows, list) for rows in data["results"].values())


def markdown(results: list[tuple[str, dict[str, Any]]], plot: str | None) -> str:
    """The generated part of the page: per file, the command, the machine and the numbers."""
    if not results:
        return "No results in `benchmarks/results/` yet.\n"
    parts = []
    for name, data in results:
        parts.append(f"### `{name}`\n")
        if data.get("command"):
            parts.append(f"```bash\n{data['command']}\n```\n")
        if data.get("machine"):
            parts.append(f"Machine: {_machine(data['machine'])}.\n")
        if is_bench(data):
            parts.append(_bench_table(data))
            if plot:
                parts.append(f"![{name}: throughput and ratio per size]({plot})\n")
        elif isinstance(data.get("ratios"), dict):
            parts.append(_flat_table(data["ratios"]))
        if not is_bench(data) and isinstance(data.get("figures"), dict):
            parts.append(_flat_table(data["figures"]))
        parts.append(f"Raw data: `benchmarks/results/{name}`.\n")
    return "\n".join(parts)


def plot_png(results: list[tuple[str, dict[str, Any]]]) -> bytes | None:
    """The plot of the first ``omni-plugins bench`` file (the bench's own plot), as PNG bytes."""
    bench = next((data for _, data in results if is_bench(data)), None)
    if bench is None:
        return None
    from omni_plugins.bench.runner import BenchResult, plot

    result = BenchResult(results=bench["results"], skipped=bench.get("skipped", {}), machine=bench.get("machine", {}))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plot.png"
        plot(result, path)
        return path.read_bytes()


def _machine(m: dict[str, Any]) -> str:
    facts = [
        f"{m['cpus']} CPUs" if "cpus" in m else "",
        f"{m['memory_gib']} GiB RAM" if "memory_gib" in m else "",
        m.get("platform", ""),
        f"Python {m['python']}" if "python" in m else "",
        f"torch {m['torch']}" if "torch" in m else "",
        "load average " + " / ".join(f"{x:.1f}" for x in m["load_avg"]) + " during the run" if "load_avg" in m else "",
    ]
    return ", ".join(f for f in facts if f)


def _bench_table(data: dict[str, Any]) -> str:
    from omni_plugins.bench.runner import format_size

    rows = [
        "| backend | size | raw GB/s | connector GB/s | ratio | raw p50 ms | connector p50 ms | operations |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, per_size in data["results"].items():
        for r in per_size:
            rows.append(
                f"| {backend} | {format_size(r['size'])} | {r['raw_gbps']:.3f} | {r['omni_gbps']:.3f} | **{r['ratio']:.2f}** "
                f"| {r['raw_p50_ms']:.3f} | {r['omni_p50_ms']:.3f} | {r['ops']} |"
            )
    text = "\n".join(rows) + "\n"
    for backend, why in data.get("skipped", {}).items():
        text += f"\nSkipped `{backend}`: {why}\n"
    return text


def _flat_table(values: dict[str, Any], prefix: str = "") -> str:
    rows = ["| measure | value |", "|---|---|"]

    def walk(d: dict[str, Any], path: str) -> None:
        for key, value in d.items():
            name = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict):
                walk(value, name)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append(f"| `{name}` | {value:.3g} |")

    walk(values, prefix)
    return "\n".join(rows) + "\n"
