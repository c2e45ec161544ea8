"""One-sided reads that wait for completion without spinning a core.

``TransferEngine.transfer_sync_read`` submits the transfer and then asks for its
status in a tight loop on the calling thread (no pause; GIL released). On a
machine with few cores that loop takes a core away from the engine's own
transport threads that move the bytes. :class:`Reader` submits with
``batch_transfer_async_read`` instead and, while waiting, gives the CPU away:
``sched_yield`` between status checks (a woken sleeper comes back late on a
loaded machine, a yielding poller at once), and for transfers expected to take
longer than :data:`SLEEP_ABOVE` seconds (from the throughput it has seen) it
first sleeps half the expected time, so a long read does not keep a core busy.
``omni-plugins bench --backends mooncake-te`` compares the connector with the raw call
(``transfer_sync_read``) and with its floor.

A read that has not completed by its deadline may still land later: the
caller must never reuse the destination memory (:data:`TIMED_OUT`).
"""

from __future__ import annotations

import os
import time
from typing import Any

DONE = 0
FAILED = -1
TIMED_OUT = -2  # still in flight: the destination may be written later

SLEEP_ABOVE = 2e-3  # seconds of expected transfer time above which the reader sleeps first
_FIRST_FRACTION = 0.5
_LATE = 1.5  # a long read still running past this multiple of its expected time polls with short sleeps
_STEPS = 50


class Reader:
    """``read(segment, local, remote, n, deadline)`` over one engine; thread-safe (the estimate is only a hint)."""

    def __init__(self, engine: Any, *, initial_rate: float = 1e9) -> None:
        self._engine = engine
        self._rate = initial_rate  # bytes/s seen recently (racy by design: only sizes the sleeps)

    def read(self, segment: str, local: int, remote: int, nbytes: int, deadline: float) -> int:
        """Copy ``nbytes`` from ``remote`` in ``segment`` to registered ``local``: DONE, FAILED or TIMED_OUT.

        ``deadline`` is a ``time.monotonic()`` value.
        """
        start = time.monotonic()
        batch = int(self._engine.batch_transfer_async_read(segment, [local], [remote], [nbytes]))
        if batch <= 0:  # the peer's segment could not be opened or the submit failed
            return FAILED
        expected = nbytes / self._rate
        step = expected / _STEPS
        if expected > SLEEP_ABOVE:  # a long read: sleep through half of it, and poll with sleeps if it runs late
            late = start + _LATE * expected
            time.sleep(min(expected * _FIRST_FRACTION, max(0.0, deadline - start)))
        else:
            late = deadline
        check = self._engine.transfer_check_status
        while True:
            status = int(check(batch))
            if status == 1:
                elapsed = time.monotonic() - start
                if elapsed > 0:
                    self._rate = 0.8 * self._rate + 0.2 * (nbytes / elapsed)
                return DONE
            if status == -1:  # failed; the engine freed the batch, nothing is in flight
                return FAILED
            now = time.monotonic()
            if status != 0 or now >= deadline:
                return TIMED_OUT  # the engine's own timeout (-2) or ours: slices may still land
            if now < late:
                os.sched_yield()
            else:
                time.sleep(step)
