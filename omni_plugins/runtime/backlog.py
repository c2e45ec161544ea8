"""Key scans a backend failure cut short, retried once when the runtime shuts down.

A dropped request's keys are freed in order until the first key that is not
there (chunks are numbered, so the first miss ends the scan). When the backend
fails instead -- a Redis server restarting, a partition -- the rest of the scan
is kept here: chunks the producer's retried puts land after the restart would
otherwise stay until their TTL. So is each key an aborted request's producer
could not free (:meth:`CleanupBacklog.keep`). :meth:`CleanupBacklog.retry` runs at shutdown,
before the connector closes, while the backend answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

from omni_plugins.contract import Connector

logger = logging.getLogger(__name__)


class CleanupBacklog:
    """Remainders of interrupted key scans (bounded: the oldest are dropped beyond ``limit``)."""

    def __init__(self, limit: int = 4096) -> None:
        self._scans: deque[tuple[Connector, list[str]]] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._scans)

    def free_in_order(self, connector: Connector, keys: Sequence[str]) -> None:
        """Free ``keys`` until the first one that is not there; a backend error keeps the rest for :meth:`retry`."""
        for i, key in enumerate(keys):
            try:
                if not connector.cleanup(key):
                    return
            except Exception:
                logger.debug("cleanup of %s failed; %d key(s) kept for a retry at shutdown", key, len(keys) - i, exc_info=True)
                with self._lock:
                    self._scans.append((connector, list(keys[i:])))
                return

    def keep(self, connector: Connector, key: str) -> None:
        """One key whose cleanup failed (not part of a scan: its neighbours may be gone for good), for :meth:`retry`."""
        with self._lock:
            self._scans.append((connector, [key]))

    def retry(self, timeout: float) -> int:
        """Run the kept scans once more, each on its connector (within ``timeout`` s, stopping at the first error;
        a connector already closed is skipped); returns keys freed."""
        with self._lock:
            scans, self._scans = list(self._scans), deque(maxlen=self._scans.maxlen)
        if not scans:
            return 0
        deadline = time.monotonic() + timeout
        freed = 0
        for n, (connector, scan) in enumerate(scans):
            if connector.closed:
                continue
            for key in scan:
                if time.monotonic() > deadline:
                    logger.warning("cleanup retry ran out of time; %d key scan(s) left to the backend's expiry", len(scans) - n)
                    return freed
                try:
                    if not connector.cleanup(key):
                        break
                except Exception as exc:
                    logger.warning("cleanup retry failed (%s); %d key scan(s) left to the backend's expiry", exc, len(scans) - n)
                    return freed
                freed += 1
        return freed
