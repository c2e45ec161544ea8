"""Per-edge counters a stage process keeps and the orchestrator merges."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: mismatch messages kept per edge (the count is always exact)
MAX_ERRORS = 20


@dataclass
class EdgeStats:
    """What one receiving rank saw on one edge (payload or KV)."""

    edge: str
    #: ``payload`` (moved by TP rank 0, checked on every rank) or ``kv`` (every rank receives its own shards)
    kind: str = "payload"
    payloads: int = 0
    bytes: int = 0
    latencies_s: list[float] = field(default_factory=list)
    first_sent: float | None = None
    last_delivered: float | None = None
    mismatches: int = 0
    errors: list[str] = field(default_factory=list)

    def delivered(self, nbytes: int, sent_at: list[float], now: float, payloads: int = 1) -> None:
        self.payloads += payloads
        self.bytes += nbytes
        self.latencies_s.extend(max(0.0, now - t) for t in sent_at)
        if sent_at:
            first = min(sent_at)
            self.first_sent = first if self.first_sent is None else min(self.first_sent, first)
        self.last_delivered = now if self.last_delivered is None else max(self.last_delivered, now)

    def mismatch(self, message: str) -> None:
        self.mismatches += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(message)

    def to_json(self) -> dict[str, Any]:
        return {
            "edge": self.edge,
            "kind": self.kind,
            "payloads": self.payloads,
            "bytes": self.bytes,
            "latencies_s": self.latencies_s,
            "first_sent": self.first_sent,
            "last_delivered": self.last_delivered,
            "mismatches": self.mismatches,
            "errors": self.errors,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EdgeStats:
        return cls(**data)

    def merge(self, other: EdgeStats) -> None:
        self.payloads += other.payloads
        self.bytes += other.bytes
        self.latencies_s.extend(other.latencies_s)
        for name, pick in (("first_sent", min), ("last_delivered", max)):
            a, b = getattr(self, name), getattr(other, name)
            setattr(self, name, b if a is None else a if b is None else pick(a, b))
        self.mismatches += other.mismatches
        self.errors.extend(other.errors[: max(0, MAX_ERRORS - len(self.errors))])
