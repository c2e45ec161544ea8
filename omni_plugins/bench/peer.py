"""Peer (placeholder while being written)."""

from __future__ import annotations

from typing import Any


def missing_peer() -> str | None:
    return "not yet"


def run_peer(opts: Any, doc: Any, bar: Any) -> None:
    raise NotImplementedError
