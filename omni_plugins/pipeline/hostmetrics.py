"""``omni-plugins run --metrics-port``: one Prometheus endpoint per host for all the stage processes it runs.

Every stage process serves its own :class:`~omni_plugins.metrics.StageMetrics`
on a free loopback port (it says which in its ``ready`` report). The host's
endpoint answers a scrape by reading each of them and merging the series --
they do not collide: each carries its process's ``stage`` label (``1``,
``1.r0`` for a replica, ``1.rank1`` for a TP rank). A stage that finished
sent its final exposition with its ``final`` report; the endpoint serves that
from then on, so the counts after a run are complete, and stay scrapeable for
``--metrics-linger`` seconds.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

from omni_plugins.metrics import Endpoint, require_prometheus

logger = logging.getLogger(__name__)

#: how long a scrape waits for one stage process's endpoint
SCRAPE_TIMEOUT_S = 2.0


class HostMetrics:
    """The merged endpoint of one host; feed it every stage report with :meth:`note`."""

    def __init__(self) -> None:
        require_prometheus()
        from prometheus_client import CollectorRegistry

        self._live: dict[str, int] = {}  # stage label -> its endpoint's port
        self._final: dict[str, str] = {}  # stage label -> its last exposition
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]  # a custom collector: collect() only
        self._endpoint = Endpoint()

    def note(self, msg: dict[str, Any], label: str | None) -> None:
        """A stage process's report: ``ready`` names its endpoint, ``final`` carries its last numbers."""
        if label is None:
            return
        kind = msg.get("kind")
        with self._lock:
            if kind == "ready" and isinstance(msg.get("metrics_port"), int):
                self._live[label] = int(msg["metrics_port"])
            elif kind == "final" and isinstance(msg.get("metrics"), str):
                self._final[label] = msg["metrics"]
                self._live.pop(label, None)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.parser import text_string_to_metric_families

        with self._lock:
            live, final = dict(self._live), dict(self._final)
        texts = list(final.values())
        for label, port in sorted(live.items()):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
                    texts.append(reply.read().decode())
            except OSError as exc:  # it just ended (its final report is on the way) or is stuck: the others still count
                logger.debug("metrics of stage %s (port %d) unreadable: %s", label, port, exc)
        families: dict[str, Any] = {}
        for text in texts:
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    families[family.name] = family
                else:
                    merged.samples.extend(family.samples)
        yield from families.values()

    def text(self) -> str:
        """The merged exposition (what a scrape returns)."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry)).decode()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the port (0: any free one)."""
        return self._endpoint.start(self.registry, port, host)

    def close(self) -> None:
        self._endpoint.close()
