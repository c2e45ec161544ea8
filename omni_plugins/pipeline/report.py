"""The run report: per-edge totals, the summary table and the JSON document."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_plugins.pipeline.stats import EdgeStats


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def edge_summary(stats: EdgeStats) -> dict[str, Any]:
    span = (stats.last_delivered - stats.first_sent) if stats.first_sent is not None and stats.last_delivered is not None else None
    p50, p99 = percentile(stats.latencies_s, 50), percentile(stats.latencies_s, 99)
    return {
        "edge": stats.edge,
        "payloads": stats.payloads,
        "bytes": stats.bytes,
        "gb_per_s": (stats.bytes / span / 1e9) if span and span > 0 else None,
        "latency_p50_ms": p50 * 1000 if p50 is not None else None,
        "latency_p99_ms": p99 * 1000 if p99 is not None else None,
        "latency_samples": len(stats.latencies_s),
        "mismatches": stats.mismatches,
        "errors": stats.errors,
    }


@dataclass
class RunReport:
    """Everything ``omni-plugins run`` found out; ``ok`` decides the exit status."""

    pipeline: str
    requests: int
    concurrency: int
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    deaths: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    servers: list[str] = field(default_factory=list)
    #: what the orchestrator freed after the stages stopped (leftovers of killed stages); not a failure by itself
    reclaimed: list[str] = field(default_factory=list)
    #: per replica of a replicated stage: requests routed to it, completed, failed; retired replicas are not alive
    replicas: list[dict[str, Any]] = field(default_factory=list)
    #: a run across hosts: each host, its stages, and why it was lost (None: it was not)
    hosts: list[dict[str, Any]] = field(default_factory=list)
    #: where this host's stage metrics were served (``--metrics-port``)
    metrics: str | None = None

    @property
    def mismatches(self) -> int:
        return sum(int(e["mismatches"]) for e in self.edges)

    @property
    def ok(self) -> bool:
        return (
            self.completed == self.requests
            and not self.failed
            and not self.lost
            and not self.deaths
            and not self.leaks
            and not self.problems
            and self.mismatches == 0
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "ok": self.ok,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "completed": self.completed,
            "failed": self.failed,
            "lost": self.lost,
            "mismatches": self.mismatches,
            "duration_s": round(self.duration_s, 3),
            "edges": self.edges,
            "deaths": self.deaths,
            "leaks": self.leaks,
            "problems": self.problems,
            "stages": self.stages,
            "servers": self.servers,
            "reclaimed": self.reclaimed,
            "replicas": self.replicas,
            "hosts": self.hosts,
            "metrics": self.metrics,
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def table(self) -> str:
        """The end-of-run summary (plain text, fixed-width)."""
        head = ("EDGE", "PAYLOADS", "BYTES", "GB/s", "P50 ms", "P99 ms", "MISMATCH")
        rows = [head]
        for e in self.edges:
            rows.append(
                (
                    e["edge"],
                    str(e["payloads"]),
                    _bytes(e["bytes"]),
                    _num(e["gb_per_s"], 3),
                    _num(e["latency_p50_ms"], 2),
                    _num(e["latency_p99_ms"], 2),
                    str(e["mismatches"]),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
        status = "OK" if self.ok else "FAILED"
        lines.append("")
        lines.append(
            f"{status}: {self.completed}/{self.requests} requests completed in {self.duration_s:.2f}s "
            f"(concurrency {self.concurrency}); lost {len(self.lost)}, failed {len(self.failed)}, "
            f"mismatches {self.mismatches}, leaks {len(self.leaks)}, dead stages {len(self.deaths)}"
        )
        for h in self.hosts:
            where = f" at {h['address']}" if h.get("address") else " (coordinator)"
            state = f" (lost: {h['lost']})" if h.get("lost") else ""
            lines.append(f"  host: {h['host']}{where}: stage(s) {', '.join(map(str, h['stages']))}{state}")
        for r in self.replicas:
            state = "" if r["alive"] else " (retired)"
            lines.append(
                f"  replica: stage {r['stage']} replica {r['replica']}{state}: {r['routed']} routed, "
                f"{r['completed']} completed, {r['failed']} failed"
            )
        for title, items in (("dead", self.deaths), ("leak", self.leaks), ("problem", self.problems), ("reclaimed", self.reclaimed)):
            lines += [f"  {title}: {item}" for item in items]
        for rid, why in list(self.failed.items())[:10]:
            lines.append(f"  failed: {rid}: {why}")
        for e in self.edges:
            lines += [f"  mismatch on {e['edge']}: {msg}" for msg in e["errors"][:5]]
        return "\n".join(lines)


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
