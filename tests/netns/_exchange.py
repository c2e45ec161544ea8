"""The test-process side of a cross-host exchange: start a producer and a consumer in two hosts, relay keys, collect.

The producer's acknowledged keys (put returned ok) are handed to the consumer
``lag`` keys behind, so gets are always in flight while the producer runs.
``faults`` are ``(trigger, action)`` pairs run in order: an int trigger runs the
action once that many puts have returned, a float one that many seconds after
the previous action (e.g. cut a host's link after 8 puts, heal it 10.0 s later).
"""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import _workers

from omni_plugins.testing.netns import TestHost
from omni_plugins.testing.processes import process_context


@dataclass
class Outcome:
    puts: dict[str, tuple[str, float, str]] = field(default_factory=dict)  # key -> (outcome, seconds, digest)
    gets: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # key -> attempts (outcome, seconds)
    health: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    closed: set[str] = field(default_factory=set)
    running: dict[str, str] = field(default_factory=dict)  # role -> the call it was in when the run ended

    @property
    def acknowledged(self) -> list[str]:
        return [k for k, (outcome, _, _) in self.puts.items() if outcome == "ok"]

    def last_get(self, key: str) -> str:
        return self.gets.get(key, [("never asked", 0.0)])[-1][0]


def exchange(
    name: str,
    producer: tuple[TestHost, dict[str, Any]],
    consumer: tuple[TestHost, dict[str, Any] | Callable[[Any], dict[str, Any]]],
    *,
    count: int,
    interval: float = 0.05,
    get_timeout: float = 5.0,
    patience: float = 60.0,
    lag: int = 0,
    faults: list[tuple[int | float, Callable[[], None]]] = (),  # type: ignore[assignment]
    deadline: float = 120.0,
) -> Outcome:
    """Run one exchange to its end (or ``deadline`` s); a consumer config may depend on the producer's address."""
    ctx = process_context()
    events, keys, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    prefix, seed = f"x{uuid.uuid4().hex[:8]}-", 11
    (p_host, p_cfg), (c_host, c_cfg) = producer, consumer
    out = Outcome()
    prod = p_host.process(ctx, _workers.produce, "producer", name, p_cfg, p_host.address, prefix, count, interval, seed, events, stop)
    prod.start()
    cons = None
    pending: list[tuple[str, str]] = []
    todo = list(faults)
    last_fault = time.monotonic()
    produced = False
    end = time.monotonic() + deadline
    try:
        while time.monotonic() < end and len(out.closed) < 2:
            try:
                event = events.get(timeout=0.1)
            except queue.Empty:
                event = None
            if event is not None:
                role, kind, *rest = event
                if kind == "ready" and role == "producer":
                    config = c_cfg(rest[0]) if callable(c_cfg) else c_cfg
                    cons = c_host.process(ctx, _workers.consume, "consumer", name, config, c_host.address, keys, get_timeout, patience, events)
                    cons.start()
                elif kind in ("putting", "getting"):
                    out.running[role] = f"{kind} {rest[0]}"
                elif kind == "put":
                    key, outcome, seconds, dig = rest
                    out.puts[key] = (outcome, seconds, dig)
                    out.running.pop(role, None)
                    if outcome == "ok":
                        pending.append((key, dig))
                elif kind == "get":
                    key, outcome, seconds = rest
                    out.gets.setdefault(key, []).append((outcome, seconds))
                    out.running.pop(role, None)
                elif kind == "produced":
                    produced = True
                elif kind == "health":
                    out.health[role] = rest[0]
                elif kind == "failed":
                    out.failures.append(f"{role}: {rest[0]}\n{rest[1]}")
                    out.closed.add(role)
                elif kind == "closed":
                    out.closed.add(role)
            while todo and (
                len(out.puts) >= todo[0][0] if isinstance(todo[0][0], int) else time.monotonic() - last_fault >= todo[0][0]
            ):
                todo.pop(0)[1]()
                last_fault = time.monotonic()
            while pending and (produced or len(pending) > lag):
                keys.put(pending.pop(0))
            if produced and not pending and not todo and cons is not None:
                keys.put(None)
                produced = False  # the end marker is sent once
            if "consumer" in out.closed:
                stop.set()
    finally:
        for action in [a for _, a in todo]:
            action()  # a heal that did not run yet (the run ended early): the network must be whole again
        stop.set()
        keys.put(None)
        for proc in (cons, prod):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
                    out.failures.append(f"{proc.name} did not exit; killed")
    return out
