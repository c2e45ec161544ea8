"""One object per request, and the registry that owns them.

Every piece of per-request bookkeeping (send counters and queue, receive
registration, caches, pending signals, KV lifecycle) lives in
:class:`RequestState`, so dropping a request is dropping one object. What
arrives on each input edge (one for most stages, one per source for a fan-in
stage) is an :class:`InputState` inside it. The registry indexes states by
internal id, with an external-id index and, per input route, an index of the
inputs registered for receiving.

All mutation happens under :attr:`RequestRegistry.lock`; the model thread and
the two I/O threads share it and never do connector I/O while holding it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omni_plugins.runtime.accumulate import FullPayloadAccumulator, resolve_pending

if TYPE_CHECKING:
    from omni_plugins.runtime.routes import InputRoute, OutputRoute


class KVPhase(enum.Enum):
    """Where a request's KV transfer is: pending (marked) -> active (drained) -> completed (acked)."""

    NONE = "none"
    PENDING = "pending"
    ACTIVE = "active"
    COMPLETED = "completed"


@dataclass(eq=False)
class SendTask:
    """One ``put`` the send thread owes: key, payload, retry bookkeeping."""

    key: str
    data: Any
    route: OutputRoute
    attempts: int = 0
    not_before: float = 0.0
    taken: bool = False  # the send thread picked it up (a handing-over ``send_chunk`` waits for this)
    queued: float = 0.0  # when the model thread handed it over (set only when its route has metrics)


@dataclass(eq=False)
class InputState:
    """One input edge of one request: where its stream is, what arrived, what the model thread has yet to see.

    A single-input stage has one per request; a fan-in stage one per input edge
    (source). They belong to their :class:`RequestState` (``request``) and go with it.
    """

    request: RequestState
    route: InputRoute
    registered: bool = False  # the receive thread looks for its next key
    next_recv_chunk: int = 0
    deadline: float | None = None
    last_arrival: float = 0.0  # or the registration time
    arrival_gap: float = 0.0  # running mean of the time between arrivals (predicts the next one)
    stream_finished: bool = False  # finish sentinel seen: never registered again
    observed: bool = False  # counted in flight on its edge's metrics (until the request is dropped)
    payload_arrived: bool = False  # full payload seen: never registered again
    merged: dict[str, Any] | None = None  # "ar" accumulation of received chunks
    cached: Any = None  # local stage payload (the runner's copy)
    has_cached: bool = False
    #: the "ar" merge left tensors to join in ``cached``'s sections (see :meth:`settle_cached`)
    pending_cat: bool = False
    #: signals of this source not yet collected (the request-level ones aggregate every source)
    wake: bool = False
    finish_signal: bool = False

    def __post_init__(self) -> None:
        #: every key of this source starts with this (``{external_id}_{key_stage}_``)
        self.key_prefix = f"{self.request.external_id}_{self.route.key_stage}_"

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def source(self) -> int:
        """The stage this input comes from."""
        return self.route.from_stage

    @property
    def delivered(self) -> bool:
        """Nothing more comes on this input (its stream finished or its full payload arrived)."""
        return self.stream_finished or self.payload_arrived

    def recv_key(self) -> str:
        return f"{self.key_prefix}{self.next_recv_chunk}"

    def set_cached(self, payload: Any) -> None:
        self.cached, self.has_cached = payload, True

    def settle_cached(self) -> Any:
        """``cached`` with the tensors the receive thread's lazy merge left pending joined (lock held).

        Every read of ``cached`` or ``merged`` outside the merge goes through here. The
        joined tensors replace the pending ones in place, in the section dicts ``cached``
        and ``merged`` share, so each is joined once.
        """
        if self.pending_cat:
            self.pending_cat = False
            resolve_pending(self.cached)
            if self.merged is not None:
                resolve_pending(self.merged)  # normally the same section dicts: nothing left to join
        return self.cached

    def pop_cached(self) -> Any:
        payload = self.settle_cached()
        self.cached, self.has_cached = None, False
        return payload

    def clear_receive(self) -> None:
        self.registered = False
        self.deadline = None
        self.merged = None
        self.cached, self.has_cached, self.pending_cat = None, False, False
        self.wake = self.finish_signal = False

    def describe(self) -> dict[str, Any]:
        return {
            "from_stage": self.route.from_stage,
            "registered": self.registered,
            "next_recv_chunk": self.next_recv_chunk,
            "stream_finished": self.stream_finished,
            "payload_arrived": self.payload_arrived,
            "has_cached": self.has_cached,
        }


@dataclass(eq=False)
class RequestState:
    """Everything the runtime knows about one request."""

    request_id: str
    external_id: str
    created: float = field(default_factory=time.monotonic)

    # -- send side ------------------------------------------------------
    #: chunks enqueued so far, per output route (``OutputRoute.index``)
    sent: list[int] = field(default_factory=list)
    send_queue: deque[SendTask] = field(default_factory=deque)
    in_flight: int = 0  # queued or being put
    in_send_ring: bool = False
    released: bool = False  # cleanup asked for; freed when in_flight reaches 0
    purge_sent: bool = False  # aborted: free what this stage put, once the last put completed
    sends_ended: bool = False  # metrics: its output edges counted it out of flight
    full_payload: FullPayloadAccumulator | None = None
    code_prompt_token_ids: list[Any] = field(default_factory=list)  # builder scratch (reference compat)

    # -- receive side: one entry per input edge ---------------------------
    inputs: list[InputState] = field(default_factory=list)

    # -- pending signals (drained by collect_signals) -------------------
    metadata: dict[str, Any] | None = None
    wake: bool = False  # a consumable chunk (or the stream end) is ready on some input
    finish_signal: bool = False  # report in chunk_finished (every input's stream ended)
    updated: bool = False  # cache changed since the last TP fan-out
    awaiting_publish: bool = False  # every full payload arrived, not yet published to the model thread
    stage_recv: bool = False  # published, report in stage_recv

    # -- KV lifecycle -----------------------------------------------------
    kv_phase: KVPhase = KVPhase.NONE
    kv_transfer: dict[str, Any] | None = None
    kv_triggered: bool = False

    # -- views over the inputs ------------------------------------------------
    @property
    def next_send_chunk(self) -> int:
        """Chunks enqueued so far (on the edge that got the most, when the stage fans out)."""
        return max(self.sent, default=0)

    @property
    def registered(self) -> bool:
        return any(i.registered for i in self.inputs)

    @property
    def stream_finished(self) -> bool:
        """Every input's stream ended."""
        return bool(self.inputs) and all(i.stream_finished for i in self.inputs)

    @property
    def payload_arrived(self) -> bool:
        """Every input's full payload arrived."""
        return bool(self.inputs) and all(i.payload_arrived for i in self.inputs)

    @property
    def has_cached(self) -> bool:
        return any(i.has_cached for i in self.inputs)

    def missing_sources(self) -> list[int]:
        """Stages whose input has not been delivered completely (a request that timed out waited for them)."""
        return [i.source for i in self.inputs if not i.delivered]

    def clear_receive(self) -> None:
        """Forget every receive-side field (the request stays known to the sender)."""
        for i in self.inputs:
            i.clear_receive()
        self.metadata = None
        self.wake = self.finish_signal = self.updated = self.awaiting_publish = self.stage_recv = False

    def has_pending_signal(self) -> bool:
        return self.wake or self.finish_signal or self.updated or self.awaiting_publish or self.stage_recv or self.metadata is not None

    def has_undelivered_input(self) -> bool:
        """Waiting for input, or input arrived that the scheduler has not been told about."""
        return self.registered or self.awaiting_publish or self.stage_recv or self.wake or self.finish_signal or self.metadata is not None

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (debugging, leak checks)."""
        first = self.inputs[0] if self.inputs else None
        out = {
            "request_id": self.request_id,
            "external_id": self.external_id,
            "next_send_chunk": self.next_send_chunk,
            "sent_per_edge": list(self.sent),
            "queued_sends": len(self.send_queue),
            "in_flight": self.in_flight,
            "released": self.released,
            "accumulating": self.full_payload is not None,
            "registered": self.registered,
            "next_recv_chunk": first.next_recv_chunk if first is not None else 0,
            "stream_finished": self.stream_finished,
            "payload_arrived": self.payload_arrived,
            "has_cached": self.has_cached,
            "merged": any(i.merged is not None for i in self.inputs),
            "kv_phase": self.kv_phase.value,
        }
        if len(self.inputs) > 1:
            out["inputs"] = [i.describe() for i in self.inputs]
        return out


@dataclass
class Outbox:
    """Events about requests whose state may already be gone, until the next collect."""

    kv_sent: list[str] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    timed_out: set[str] = field(default_factory=set)
    #: ids dropped by the TP leader that followers must drop too (sent in the next packet)
    dropped_for_followers: list[tuple[str, str]] = field(default_factory=list)
    #: per failed or timed-out request, the source stages it did not get everything from
    missing: dict[str, list[int]] = field(default_factory=dict)

    def forget(self, ids: set[str]) -> None:
        self.kv_sent = [i for i in self.kv_sent if i not in ids]
        self.failed -= ids
        self.timed_out -= ids
        self.dropped_for_followers = [d for d in self.dropped_for_followers if d[0] not in ids]
        for rid in ids & self.missing.keys():
            del self.missing[rid]

    def __len__(self) -> int:
        return len(self.kv_sent) + len(self.failed) + len(self.timed_out) + len(self.dropped_for_followers) + len(self.missing)


class RequestRegistry:
    """States by internal id, with an external-id index and a receiving index per input route.

    ``inputs`` are the runtime's input routes (every state gets one :class:`InputState`
    per route), ``outputs`` the number of its output routes (send counters per route).
    """

    def __init__(self, inputs: Sequence[InputRoute] = (), outputs: int = 1) -> None:
        self.lock = threading.RLock()
        self._states: dict[str, RequestState] = {}
        self._by_external: dict[str, str] = {}
        self._routes = tuple(inputs)
        self._outputs = outputs
        #: registered inputs by request id, one dict per input route, oldest last arrival first
        self._receiving: list[dict[str, InputState]] = [{} for _ in self._routes]
        self._signalled: dict[str, RequestState] = {}
        self.outbox = Outbox()
        #: bumped whenever the receiving set changes (the receive thread re-plans only then)
        self.epoch = 0
        #: metrics: whether requests are counted in flight on their edges, and the observer of each output route
        #: (see :mod:`omni_plugins.runtime.observe`)
        self.observed = False
        self.send_observers: tuple[Any, ...] = ()

    # -- lookup -----------------------------------------------------------
    def get(self, request_id: str) -> RequestState | None:
        """The state for an internal id, else for an external id, else None."""
        state = self._states.get(request_id)
        if state is None:
            internal = self._by_external.get(request_id)
            state = self._states.get(internal) if internal is not None else None
        return state

    def lookup(self, request_id: str) -> RequestState | None:
        """The state for an internal id, or None; one atomic dict read, safe without the lock."""
        return self._states.get(request_id)

    def ensure(self, request_id: str, external_id: str | None = None) -> RequestState:
        """The state for ``request_id``, created when missing."""
        state = self._states.get(request_id)
        if state is None:
            ext = external_id if external_id is not None else request_id
            state = RequestState(request_id, ext, sent=[0] * self._outputs)
            state.inputs = [InputState(state, route) for route in self._routes]
            self._states[request_id] = state
            self._by_external.setdefault(ext, request_id)
        return state

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._states.values()))

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and self.get(request_id) is not None

    # -- receiving index --------------------------------------------------
    def set_registered(self, entry: InputState, registered: bool) -> None:
        entry.registered = registered
        index = self._receiving[entry.route.index]
        if registered:
            if self.observed and not entry.observed:
                entry.observed = True
                entry.route.observer.started()
            index[entry.request.request_id] = entry
        elif index.pop(entry.request.request_id, None) is None:
            return
        self.epoch += 1

    def receiving(self, routes: Sequence[int] | None = None) -> list[InputState]:
        """Registered inputs (of ``routes``, default all), the one whose last arrival is oldest first per route."""
        return list(self.receiving_iter(routes))

    def receiving_iter(self, routes: Sequence[int] | None = None) -> Iterator[InputState]:
        """Registered inputs, oldest last arrival first per route, without copying (lock held, no mutation)."""
        if routes is None:
            routes = range(len(self._receiving))
        if len(routes) == 1:
            return iter(self._receiving[routes[0]].values())
        return (entry for r in routes for entry in self._receiving[r].values())

    def touch(self, entry: InputState) -> None:
        """``entry`` just received: move it to the back of its route's receiving order."""
        index = self._receiving[entry.route.index]
        rid = entry.request.request_id
        if index.pop(rid, None) is entry:
            index[rid] = entry

    # -- signalled index: states that may carry pending signals ----------------
    def signal(self, state: RequestState) -> None:
        """Note that ``state`` has something for the model thread (so collection visits only these)."""
        self._signalled[state.request_id] = state

    def signalled(self) -> list[RequestState]:
        return list(self.signalled_iter())

    def signalled_iter(self) -> Iterator[RequestState]:
        """The live signalled states, without building a list first (lock held, no mutation while iterating)."""
        states = self._states
        return (s for rid, s in self._signalled.items() if states.get(rid) is s)

    def take_signalled(self) -> list[RequestState]:
        """The live signalled states, forgetting the index: the caller drains them and re-signals any still pending."""
        states = self._states
        live = [s for rid, s in self._signalled.items() if states.get(rid) is s]
        self._signalled = {}
        return live

    def settle(self) -> bool:
        """Forget states whose signals were all drained; True if any state still has a pending signal."""
        self._signalled = {rid: s for rid, s in self._signalled.items() if s.has_pending_signal() and self._states.get(rid) is s}
        return bool(self._signalled)

    # -- removal ------------------------------------------------------------
    def drop(self, state: RequestState) -> None:
        """Forget ``state`` entirely."""
        if self._states.get(state.request_id) is state:
            del self._states[state.request_id]
        if self._by_external.get(state.external_id) == state.request_id:
            del self._by_external[state.external_id]
        for entry in state.inputs:
            index = self._receiving[entry.route.index]
            if index.get(state.request_id) is entry:
                del index[state.request_id]
                self.epoch += 1
            entry.registered = False
        if self._signalled.get(state.request_id) is state:
            del self._signalled[state.request_id]
        self._ended(state)

    def _ended(self, state: RequestState) -> None:
        """Metrics: ``state``'s request is no longer in flight on any edge it used."""
        if not self.observed:
            return
        for entry in state.inputs:
            if entry.observed:
                entry.observed = False
                entry.route.observer.ended()
        observers = self.send_observers
        if observers and not state.sends_ended:
            state.sends_ended = True
            for i, count in enumerate(state.sent):
                if count:
                    observers[i].ended()

    def release(self, state: RequestState) -> None:
        """Drop ``state`` now, except that send-side state waits for in-flight sends."""
        for entry in state.inputs:
            self.set_registered(entry, False)
        state.clear_receive()
        state.full_payload = None
        state.kv_phase, state.kv_transfer, state.kv_triggered = KVPhase.NONE, None, False
        state.code_prompt_token_ids = []
        if state.in_flight:
            state.released = True
        else:
            self.drop(state)

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": {s.request_id: s.describe() for s in self._states.values()},
            "external_index": len(self._by_external),
            "receiving": sorted({rid for index in self._receiving for rid in index}),
            "signalled": len(self._signalled),
            "outbox": len(self.outbox),
        }
