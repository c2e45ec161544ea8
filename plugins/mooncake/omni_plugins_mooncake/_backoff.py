"""Polling with a bounded, growing delay (for ``get(..., timeout=t)`` on backends that cannot notify)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(attempt: Callable[[], T | None], timeout: float | None, first_delay: float, max_delay: float = 0.05) -> T | None:
    """Call ``attempt`` until it returns non-None or ``timeout`` seconds pass (``None``/0: try once)."""
    result = attempt()
    if result is not None or not timeout or timeout <= 0:
        return result
    deadline = time.monotonic() + timeout
    delay = first_delay
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_delay)
        result = attempt()
        if result is not None:
            return result
