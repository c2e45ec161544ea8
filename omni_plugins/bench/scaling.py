"""Scaling (placeholder while being written)."""

from __future__ import annotations

from typing import Any


def run_scaling(opts: Any, doc: Any, bar: Any) -> None:
    raise NotImplementedError
