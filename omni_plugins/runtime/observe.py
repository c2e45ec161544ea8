"""Metrics of a runtime's edges: each route reports to its observer, the registry says when requests come and go.

Given ``metrics=`` (a :class:`~omni_plugins.metrics.StageMetrics`), a
:class:`~omni_plugins.runtime.StageTransferRuntime` binds one
:class:`~omni_plugins.metrics.EdgeObserver` to each of its routes, per edge
(``0->1``), connector instance and direction, and watches every connector's
``health()``. Then:

* **send**: the send thread reports every put that succeeded (its serialized
  size, and the time from the model's hand-over to the put returning) and every
  payload dropped after its retries (``reason="put"``);
* **receive**: the receive thread reports every payload taken from the
  backend (its serialized size) and every request that failed on the edge
  (``timeout``, ``decode``, ``malformed``). The producer-to-consumer hand-off
  latency needs the producer's send time, which only the model knows: it
  reports it with :meth:`~omni_plugins.metrics.EdgeObserver.handoff`
  (:meth:`StageTransferRuntime.edge_observer` finds the observer);
* **in flight**: a request counts on an output edge from its first payload
  enqueued there, on an input edge from its first registration there, until the
  runtime drops its state.

Without metrics every route keeps :data:`~omni_plugins.metrics.NO_OBSERVER`
and the registry skips the bookkeeping: the hot paths pay one no-op call per put and get.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omni_plugins.contract import Connector
from omni_plugins.metrics import Direction, EdgeObserver
from omni_plugins.runtime.routes import InputRoute, OutputRoute
from omni_plugins.runtime.state import RequestRegistry


def edge_name(from_stage: int, to_stage: int) -> str:
    """The ``edge`` label of the series: ``0->1``."""
    return f"{from_stage}->{to_stage}"


def _connector_label(route: OutputRoute | InputRoute) -> str:
    return route.instance or route.connector.name


def bind(
    metrics: Any,
    registry: RequestRegistry,
    outputs: Sequence[OutputRoute],
    inputs: Sequence[InputRoute],
    connectors: Mapping[str, Connector],
) -> None:
    """Give every route its observer, turn the registry's in-flight bookkeeping on, watch every connector's health."""
    for out in outputs:
        out.observer = metrics.edge(edge_name(out.from_stage, out.to_stage), _connector_label(out), "send")
    for inp in inputs:
        inp.observer = metrics.edge(edge_name(inp.from_stage, inp.to_stage), _connector_label(inp), "receive")
    registry.send_observers = tuple(out.observer for out in sorted(outputs, key=lambda r: r.index))
    registry.observed = True
    for instance, connector in connectors.items():
        metrics.watch_connector(instance, connector.health)


def unbind(metrics: Any, connectors: Mapping[str, Connector]) -> None:
    """Stop reading the connectors' health (they are about to close); the counters keep their values."""
    for instance in connectors:
        metrics.unwatch_connector(instance)


def find(metrics: Any, from_stage: int, to_stage: int, connector: str, direction: Direction) -> EdgeObserver:
    """The observer of one edge and direction (the one its route reports to)."""
    return metrics.edge(edge_name(from_stage, to_stage), connector, direction)  # type: ignore[no-any-return]
