"""The performance page's measurements: ``benchmarks/results/*.json`` as tables and plots.

The only source of the numbers the docs quote. Every results file is a document of
``omni-plugins bench --json`` (:mod:`omni_plugins.bench.schema`): per file, the command, the
machine, each section's table, the targets with their verdicts and a plot. A file in any other
format fails the build (one format for every result). Nothing here measures anything.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from omni_plugins.bench.schema import SCHEMA, BenchDocument, Machine

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def load() -> list[tuple[str, BenchDocument]]:
    """``(file name, document)`` of every results file, sorted by name; a file in another format is an error."""
    out = []
    for path in sorted(RESULTS_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{path.relative_to(ROOT)} is not an omni-plugins bench document (schema {SCHEMA!r}); write it with --json")
        out.append((path.name, BenchDocument.model_validate(data)))
    return out


def plot_name(file_name: str) -> str:
    """The site path of a results file's plot."""
    return f"benchmark-{Path(file_name).stem}.png"


def markdown(results: list[tuple[str, BenchDocument]], plots: dict[str, str]) -> str:
    """The generated part of the page: per file, the command, the machine, every section and every target."""
    if not results:
        return "No results in `benchmarks/results/` yet.\n"
    parts = []
    for name, doc in results:
        parts.append(f"### `{name}`\n")
        if not doc.final:
            parts.append('!!! warning "A short run"\n    Made with `--quick` to check the harness: not figures to quote.\n')
        if doc.command:
            parts.append(f"```bash\n{doc.command}\n```\n")
        parts.append(f"Machine: {_machine(doc.machine)}.\n")
        for key, section in doc.sections.items():
            parts.append(f"#### {section.title}\n")
            parts.append(section.about + "\n")
            if section.setup:
                parts.append("Set-up: " + ", ".join(f"{k} `{v}`" for k, v in section.setup.items()) + ".\n")
            parts.append(_table(doc.table(key)))
        if doc.targets:
            parts.append("#### Targets\n")
            parts.append(_targets(doc))
        for what, why in doc.skipped.items():
            parts.append(f"Not measured, {what}: {why}\n")
        if name in plots:
            parts.append(f"![{name}]({plots[name]})\n")
        parts.append(f"Raw data: `benchmarks/results/{name}`.\n")
    return "\n".join(parts)


def plottable(doc: BenchDocument) -> bool:
    """Whether the document has a section the bench's plot draws."""
    from omni_plugins.bench.plot import plottable as has_panels

    return has_panels(doc)


def plot_png(doc: BenchDocument) -> bytes:
    """The document's plot (``omni-plugins bench --plot``), as PNG bytes."""
    from omni_plugins.bench.plot import plot

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plot.png"
        plot(doc, path)
        return path.read_bytes()


def _machine(m: Machine) -> str:
    facts = [
        f"{m.cpus} CPUs" if m.cpus else "",
        f"{m.memory_gib} GiB RAM" if m.memory_gib else "",
        m.platform,
        f"Python {m.python}" if m.python else "",
        f"torch {m.torch}" if m.torch else "",
        "load average " + " / ".join(f"{x:.1f}" for x in m.load_avg_start) + " at the start" if m.load_avg_start else "",
        "and " + " / ".join(f"{x:.1f}" for x in m.load_avg_end) + " at the end" if m.load_avg_end else "",
    ]
    return ", ".join(f for f in facts if f)


def _table(cells: list[list[str]]) -> str:
    head, *rows = cells
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _targets(doc: BenchDocument) -> str:
    cells = [["target", "subject", "measured", "bound", "where", "met", "same-run floor"]]
    for t in doc.targets:
        measured = "-" if t.measured is None else f"{t.measured:.3g}"
        met = "not measured" if t.met is None else ("**met**" if t.met else "**not met**")
        floor = "-"
        if t.floor is not None:
            floor = f"{t.floor:.3g}" + (" (out of reach)" if t.reachable is False and not t.met else "")
        cells.append(
            [t.description + (f" ({t.note})" if t.note else ""), t.subject, measured, f"{t.op} {t.bound:g}", t.at or "-", met, floor]
        )
    return _table(cells)
