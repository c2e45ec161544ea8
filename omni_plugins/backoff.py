"""Waiting between attempts: a pause that doubles up to a bound and never passes a deadline.

The one retry/backoff helper of the project and its plugins. :class:`Backoff` is the
pause itself, for loops that do more than one call per attempt;
:func:`poll` is the common loop "call until it returns something or the time is up".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Backoff:
    """Pauses of ``first`` seconds, doubling up to ``maximum``, cut short at ``deadline`` (``time.monotonic()``; None: none).

    ``first=0`` retries at once every time.

    ``sleep()`` pauses and says whether the caller should try again; ``reset()`` starts
    over at ``first`` (after progress).
    """

    __slots__ = ("deadline", "delay", "first", "maximum")

    def __init__(self, first: float, maximum: float, deadline: float | None = None) -> None:
        if not 0 <= first <= maximum:
            raise ValueError(f"backoff needs 0 <= first <= maximum, got first={first}, maximum={maximum}")
        self.first = first
        self.maximum = maximum
        self.deadline = deadline
        self.delay = first

    @classmethod
    def within(cls, timeout: float, first: float, maximum: float) -> Backoff:
        """Pauses for at most ``timeout`` seconds from now."""
        return cls(first, maximum, time.monotonic() + timeout)

    def remaining(self) -> float:
        """Seconds left before the deadline (``inf`` without one; never below 0)."""
        return math.inf if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def sleep(self, wait: Callable[[float], object] = time.sleep) -> bool:
        """Pause (with ``wait``, e.g. an ``Event.wait``) and double the next pause; False, without pausing, once the deadline passed."""
        remaining = self.remaining()
        if remaining <= 0:
            return False
        pause = min(self.delay, remaining)
        self.delay = min(self.delay * 2, self.maximum)
        if pause > 0:
            wait(pause)
        return True

    def reset(self) -> None:
        self.delay = self.first


def poll(attempt: Callable[[], T | None], timeout: float | None, first: float, maximum: float = 0.05) -> T | None:
    """Call ``attempt`` until it returns non-None or ``timeout`` seconds pass (``None`` or 0: try once)."""
    result = attempt()
    if result is not None or not timeout or timeout <= 0:
        return result
    backoff = Backoff.within(timeout, first, maximum)
    while backoff.sleep():
        result = attempt()
        if result is not None:
            return result
    return None
