"""Prometheus metrics of a stage process: what crosses each edge, how fast, what fails, and connector health.

The runtime reports through a small observer interface and never touches
Prometheus itself: :meth:`StageMetrics.edge` returns an :class:`EdgeObserver`
for one edge and direction, whose calls (:meth:`~EdgeObserver.started`,
:meth:`~EdgeObserver.delivered`, :meth:`~EdgeObserver.failed`,
:meth:`~EdgeObserver.ended`, :meth:`~EdgeObserver.handoff`) update the series
below. A :class:`~omni_plugins.runtime.StageTransferRuntime` given
``metrics=`` reports every put and get of its edges itself (see
:mod:`omni_plugins.runtime.observe`). A runtime that has no metrics uses :data:`NO_OBSERVER`, which
does nothing. Connector health is read when Prometheus scrapes
(:meth:`StageMetrics.watch_connector`): every number in ``health()`` becomes a
gauge, so a plugin's own fields show up with no code in the core.

Series (labels ``stage``, ``edge`` e.g. ``0->1``, ``connector``, ``direction``
``send`` or ``receive``):

==========================================  =========  ==================================================
``omni_payloads_total``                     counter    payloads handed over (sent / delivered)
``omni_payload_bytes_total``                counter    their bytes
``omni_handoff_latency_seconds``            histogram  send: the model's hand-over to the put done; receive:
                                                       producer's send to consumer's hand-off (``handoff()``)
``omni_transfer_failures_total``            counter    failed transfers, by ``reason``
``omni_requests_in_flight``                 gauge      requests started on the edge and not yet finished
``omni_connector_up``                       gauge      1 when ``health()["ok"]``, else 0 (labels stage, connector)
``omni_connector_health``                   gauge      every numeric ``health()`` field, by ``field`` (nested: ``a.b``)
==========================================  =========  ==================================================

Each :class:`StageMetrics` has its own registry, so several in one process
(tests, a process hosting several stages) do not collide; :meth:`StageMetrics.serve`
exposes it over HTTP. Needs the ``metrics`` extra (``prometheus-client``):
:func:`require_prometheus` says so before anything starts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Protocol

logger = logging.getLogger(__name__)

Direction = Literal["send", "receive"]

#: hand-off latency buckets, seconds: sub-millisecond shared memory up to multi-second cross-host KV hand-offs
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_EDGE_LABELS = ("stage", "edge", "connector", "direction")


def require_prometheus() -> None:
    """Raise a clear error now when the ``metrics`` extra is missing (call before starting any work)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("metrics need prometheus-client: pip install 'omni-plugins[metrics]'") from exc


class EdgeObserver(Protocol):
    """What a runtime reports about one edge in one direction."""

    def started(self) -> None:
        """A request began using this edge (in flight until delivered or failed)."""

    def delivered(self, nbytes: int, latency: float | None = None, *, finished: bool = True) -> None:
        """A payload of ``nbytes`` went through (``latency``: put-to-hand-off seconds, receive side).

        ``finished=False`` for one chunk of a stream: the request stays in flight.
        """

    def failed(self, reason: str, *, finished: bool = True) -> None:
        """A transfer failed (``reason``: a short class such as ``timeout``, ``decode``, ``connector``)."""

    def ended(self) -> None:
        """A request stopped using this edge (no longer in flight) with no transfer outcome to report."""

    def handoff(self, latency: float) -> None:
        """One hand-off latency measured by whoever knows the producer's send time (the model), no payload counted."""


class _NoObserver:
    def started(self) -> None:
        pass

    def delivered(self, nbytes: int, latency: float | None = None, *, finished: bool = True) -> None:
        pass

    def failed(self, reason: str, *, finished: bool = True) -> None:
        pass

    def ended(self) -> None:
        pass

    def handoff(self, latency: float) -> None:
        pass


#: the observer of a runtime without metrics: every call does nothing
NO_OBSERVER: EdgeObserver = _NoObserver()


class _Edge:
    """An :class:`EdgeObserver` over the series of one (edge, direction)."""

    def __init__(self, metrics: StageMetrics, labels: tuple[str, ...]) -> None:
        self._payloads = metrics._payloads.labels(*labels)
        self._bytes = metrics._bytes.labels(*labels)
        self._latency = metrics._latency.labels(*labels)
        self._in_flight = metrics._in_flight.labels(*labels)
        self._failures = metrics._failures
        self._labels = labels

    def started(self) -> None:
        self._in_flight.inc()

    def delivered(self, nbytes: int, latency: float | None = None, *, finished: bool = True) -> None:
        self._payloads.inc()
        self._bytes.inc(nbytes)
        if latency is not None:
            self._latency.observe(max(0.0, latency))
        if finished:
            self._in_flight.dec()

    def failed(self, reason: str, *, finished: bool = True) -> None:
        self._failures.labels(*self._labels, reason).inc()
        if finished:
            self._in_flight.dec()

    def ended(self) -> None:
        self._in_flight.dec()

    def handoff(self, latency: float) -> None:
        self._latency.observe(max(0.0, latency))


class StageMetrics:
    """The metrics of one stage process: edge observers, watched connectors, an HTTP endpoint."""

    def __init__(self, stage: str) -> None:
        require_prometheus()
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.stage = str(stage)
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._payloads = Counter("omni_payloads", "payloads handed over on an edge", _EDGE_LABELS, registry=reg)
        self._bytes = Counter("omni_payload_bytes", "bytes of payloads handed over on an edge", _EDGE_LABELS, registry=reg)
        self._latency = Histogram(
            "omni_handoff_latency_seconds", "producer put to consumer hand-off", _EDGE_LABELS, buckets=LATENCY_BUCKETS, registry=reg
        )
        self._failures = Counter("omni_transfer_failures", "failed transfers on an edge", (*_EDGE_LABELS, "reason"), registry=reg)
        self._in_flight = Gauge("omni_requests_in_flight", "requests started on an edge and not finished", _EDGE_LABELS, registry=reg)
        self._edges: dict[tuple[str, ...], _Edge] = {}
        self._lock = threading.Lock()
        self._health = _HealthCollector(self.stage)
        reg.register(self._health)
        self._endpoint = Endpoint()

    def edge(self, edge: str, connector: str, direction: Direction) -> EdgeObserver:
        """The observer of ``edge`` (e.g. ``"0->1"``) over ``connector`` in ``direction`` (one per combination)."""
        if direction not in ("send", "receive"):
            raise ValueError(f"direction must be 'send' or 'receive', got {direction!r}")
        labels = (self.stage, str(edge), str(connector), direction)
        with self._lock:
            observer = self._edges.get(labels)
            if observer is None:
                observer = self._edges[labels] = _Edge(self, labels)
            return observer

    def watch_connector(self, name: str, health: Callable[[], Mapping[str, Any]]) -> None:
        """Export ``health()`` (e.g. ``connector.health``) under ``connector=name`` at every scrape."""
        self._health.watch(name, health)

    def unwatch_connector(self, name: str) -> None:
        self._health.unwatch(name)

    def exposition(self) -> bytes:
        """The current metrics in Prometheus' text format (what a scrape returns)."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread (port 0: any free one); returns the port."""
        if self._endpoint.port is not None:
            raise RuntimeError(f"stage {self.stage} metrics are already served on port {self.port}")
        return self._endpoint.start(self.registry, port, host)

    @property
    def port(self) -> int | None:
        return self._endpoint.port

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._endpoint.close()

    def __enter__(self) -> StageMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Endpoint:
    """A registry served over HTTP (prometheus_client's server, on a daemon thread) until :meth:`close`."""

    def __init__(self) -> None:
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, registry: Any, port: int, host: str) -> int:
        """Serve ``registry`` on ``host:port`` (0: any free port); returns the port."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        return int(self._server.server_address[1])

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _HealthCollector:
    """A custom collector: calls each watched connector's ``health()`` when scraped."""

    def __init__(self, stage: str) -> None:
        self._stage = stage
        self._sources: dict[str, Callable[[], Mapping[str, Any]]] = {}
        self._lock = threading.Lock()

    def watch(self, name: str, health: Callable[[], Mapping[str, Any]]) -> None:
        with self._lock:
            self._sources[name] = health

    def unwatch(self, name: str) -> None:
        with self._lock:
            self._sources.pop(name, None)

    def describe(self) -> list[Any]:
        return []  # series appear with the connectors watched (an unchecked collector for the registry)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("omni_connector_up", "1 when the connector's health() says ok", labels=["stage", "connector"])
        fields = GaugeMetricFamily("omni_connector_health", "numeric health() fields", labels=["stage", "connector", "field"])
        with self._lock:
            sources = list(self._sources.items())
        for name, health in sources:
            try:
                report = health()
            except Exception as exc:  # a scrape must not fail because one backend is down
                logger.debug("health() of connector %s failed during a metrics scrape: %s", name, exc)
                up.add_metric([self._stage, name], 0.0)
                continue
            up.add_metric([self._stage, name], 1.0 if report.get("ok") else 0.0)
            for field, value in _numbers(report):
                fields.add_metric([self._stage, name, field], value)
        yield up
        yield fields


def _numbers(report: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every int/float/bool in a (nested) health dict, keyed ``a.b``; ``ok`` is reported as ``omni_connector_up``."""
    for key, value in report.items():
        name = f"{prefix}{key}"
        if name == "ok":
            continue
        if isinstance(value, (int, float)):  # bool is an int
            yield name, float(value)
        elif isinstance(value, Mapping):
            yield from _numbers(value, f"{name}.")


@contextlib.contextmanager
def served(stage: str, port: int = 0, host: str = "127.0.0.1") -> Iterator[StageMetrics]:
    """A :class:`StageMetrics` served over HTTP for the ``with`` block."""
    metrics = StageMetrics(stage)
    metrics.serve(port, host)
    try:
        yield metrics
    finally:
        metrics.close()
