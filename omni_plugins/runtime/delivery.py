"""Receive-side semantics: what an arrival does to a request, and what the model thread sees.

The receive threads call :class:`Delivery` (as their ArrivalHandler) under the
registry lock, then :meth:`Delivery.publish` once per batch of arrivals; the runtime calls the ``take_*``/``apply_*`` methods on the
model thread. Packets exchanged between TP ranks are plain dicts of lists so
they can be wire-encoded.

Arrivals come per input (:class:`InputState`). A single-input stage sees one
payload per request. A fan-in stage (several input edges) keeps each source's
payload apart and hands the model thread ``{source_stage: payload}``: a full
payload is published once every source delivered; a stream wakes the request
when any source has something consumable, the signals say which sources
(``chunk_ready_sources``, ``chunk_finished_sources``), and the request's input
is finished once every source's stream is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from omni_plugins.contract import Connector
from omni_plugins.runtime.accumulate import merge_chunk
from omni_plugins.runtime.consumable import chunk_flags, has_content, payload_audio_codes, payload_is_consumable, scheduling_metadata
from omni_plugins.runtime.state import InputState, RequestRegistry, RequestState
from omni_plugins.runtime.wakeflag import WakeFlag

logger = logging.getLogger(__name__)


def shallow_copy(payload: Any) -> Any:
    return dict(payload) if isinstance(payload, dict) else payload


def _copy_sections(payload: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``payload`` and of each of its section dicts (values are shared)."""
    return {k: dict(v) if type(v) is dict or isinstance(v, dict) else v for k, v in payload.items()}


class Delivery:
    """Receive-side rules for one stage (full-payload or streaming, ``ar`` or ``generation``; one input or fan-in)."""

    def __init__(
        self,
        registry: RequestRegistry,
        *,
        async_chunk: bool,
        worker_type: str,
        recv_timeout_s: float,
        abort_scan_limit: int,
        multi_rank: bool,
        fan_in: bool = False,
    ) -> None:
        self._registry = registry
        self.async_chunk = async_chunk
        self.worker_type = worker_type
        self.recv_timeout_s = recv_timeout_s
        self._scan = abort_scan_limit
        self._multi_rank = multi_rank
        #: several input edges: payloads are ``{source_stage: payload}``
        self.fan_in = fan_in
        #: set whenever the model thread has something to pick up (see ``wait_ready``)
        self.ready = WakeFlag()
        #: requests whose full payloads all arrived and are not yet published (read without the lock for a fast path)
        self.unpublished = 0
        self._ready_due = False  # something was delivered since the last publish()

    # -- keys -------------------------------------------------------------------
    def recv_key(self, entry: InputState) -> str:
        return f"{entry.key_prefix}{entry.next_recv_chunk}"

    def abort_keys(self, state: RequestState) -> list[tuple[Connector, list[str]]]:
        """Per connector, keys of chunks that may have been put for ``state`` but will never be read."""
        out = []
        for entry in state.inputs:
            if entry.registered:
                first = entry.next_recv_chunk
                out.append((entry.route.connector, [f"{entry.key_prefix}{i}" for i in range(first, first + self._scan)]))
        return out

    # -- ArrivalHandler (receive thread, lock held) -------------------------------
    def pollable(self, entry: InputState) -> bool:
        if not self.async_chunk or self.worker_type == "ar":
            return True
        # generation workers keep one chunk in flight per source: the previous one must reach
        # the scheduler (signals collected) and the runner (cache consumed) first
        if entry.wake or entry.request.metadata is not None:
            return False
        return not (entry.has_cached and payload_is_consumable(entry.cached))

    def on_payload(self, entry: InputState, payload: Any) -> None:
        """One arrival. Raises (state unchanged as far as the stream position goes) when the payload
        breaks the payload rules; the receive thread then reports the request failed."""
        if self.async_chunk:
            self._on_chunk(entry, payload)
        else:
            self._on_full_payload(entry, payload)
        now = time.monotonic()
        if entry.next_recv_chunk:  # registration -> first chunk is prefill time, not a chunk gap
            gap = now - entry.last_arrival
            entry.arrival_gap = gap if not entry.arrival_gap else 0.7 * entry.arrival_gap + 0.3 * gap
        entry.next_recv_chunk += 1
        entry.last_arrival = now
        if entry.deadline is not None:  # a finished stream or an arrived full payload waits no more
            entry.deadline = now + self.recv_timeout_s
        self._registry.touch(entry)

    def on_failure(self, entry: InputState, *, timed_out: bool) -> list[tuple[Connector, list[str]]]:
        """The request of ``entry`` failed (every input of it is dropped); returns keys to clean per connector."""
        state = entry.request
        keys = self.abort_keys(state)
        outbox = self._registry.outbox
        (outbox.timed_out if timed_out else outbox.failed).add(state.request_id)
        if timed_out:
            outbox.missing[state.request_id] = state.missing_sources()
        if self._multi_rank:
            outbox.dropped_for_followers.append((state.request_id, "timed_out" if timed_out else "failed"))
        self._registry.release(state)
        self._ready_due = True
        return keys

    def publish(self) -> None:
        """Wake the model thread once for everything delivered since the last call (lock held)."""
        if self._ready_due:
            self._ready_due = False
            self.ready.set()

    def unread(self) -> bool:
        """The model thread has not collected everything published yet (``collect_signals`` clears it)."""
        return self.ready.is_set()

    def _on_chunk(self, entry: InputState, chunk: Any) -> None:
        # runs for every chunk on the receive thread: each type test once, both predicates in one pass
        state = entry.request
        is_dict = type(chunk) is dict or isinstance(chunk, dict)
        if is_dict:
            finished, consumable = chunk_flags(chunk)
        else:
            finished, consumable = False, chunk is not None  # what payload_finished says of a non-dict
        data: Any
        if is_dict and self.worker_type == "ar":
            # a new dict (copied into the cache below); tensors to concatenate are left pending: joined
            # once, on the thread that reads the payload (``InputState.settle_cached``)
            entry.merged = data = merge_chunk(entry.merged, chunk, lazy=True)
            entry.pending_cat = True
        else:
            if self.worker_type == "generation" and not finished and not has_content(payload_audio_codes(chunk)):
                logger.debug("request %s: chunk without audio codes ignored", state.request_id)
                return
            data = chunk
        cached = entry.cached
        if is_dict and entry.has_cached and isinstance(cached, dict):
            # merged into a new dict, never in place: the model thread reads a dict it got from the cache
            # without the lock, and an update would swap its settled sections for ones still pending
            entry.set_cached({**cached, **data})
        else:
            entry.set_cached(shallow_copy(data))
        state.updated = True
        self._note_metadata(state, entry.cached)
        if consumable or finished:
            entry.wake = state.wake = True
        if finished:
            entry.finish_signal = True
            entry.stream_finished = True
            entry.deadline = None
            self._registry.set_registered(entry, False)
            if not self.fan_in or state.stream_finished:
                state.finish_signal = True
        self._registry.signal(state)
        self._ready_due = True

    def _note_metadata(self, state: RequestState, payload: Any) -> None:
        found = scheduling_metadata(payload)
        if self.fan_in and found and state.metadata:
            state.metadata = {**state.metadata, **found}  # every source's scheduling metadata, the latest winning
        else:
            state.metadata = found or state.metadata

    def _on_full_payload(self, entry: InputState, payload: Any) -> None:
        state = entry.request
        inputs = payload.get("engine_inputs", payload) if isinstance(payload, dict) else payload
        entry.set_cached(shallow_copy(inputs))
        entry.payload_arrived = True
        entry.deadline = None
        self._registry.set_registered(entry, False)
        if self.fan_in and not state.payload_arrived:
            return  # published once every source delivered
        state.awaiting_publish = True
        self.unpublished += 1
        self._registry.signal(state)
        self._ready_due = True

    # -- what the model thread gets ---------------------------------------------------
    def payload_of(self, state: RequestState) -> Any:
        """The request's cached input (lock held): the payload, or ``{source_stage: payload}`` on a fan-in stage (None: nothing)."""
        if not self.fan_in:
            return state.inputs[0].settle_cached() if state.inputs else None
        got = {e.source: e.settle_cached() for e in state.inputs if e.has_cached}
        return got or None

    def pop_payload(self, state: RequestState) -> Any:
        """:meth:`payload_of`, removing it from the cache."""
        if not self.fan_in:
            return state.inputs[0].pop_cached() if state.inputs else None
        got = {e.source: e.pop_cached() for e in state.inputs if e.has_cached}
        return got or None

    def _packed(self, state: RequestState, *, only_woken: bool = False) -> Any:
        """The request's cached input for a TP packet: the payload, or ``{"<source>": payload}`` (wire keys are strings)."""
        if not self.fan_in:
            return shallow_copy(state.inputs[0].settle_cached())
        return {str(e.source): shallow_copy(e.settle_cached()) for e in state.inputs if e.has_cached and (e.wake or not only_woken)}

    def _unpacked(self, state: RequestState, packed: Any) -> None:
        """Follower / publish: store a packed input in the request's inputs."""
        if not self.fan_in:
            state.inputs[0].set_cached(packed)
            return
        by_source = {e.source: e for e in state.inputs}
        for source, payload in (packed or {}).items():
            entry = by_source.get(int(source))
            if entry is not None:
                entry.set_cached(payload)

    # -- model thread: full-payload mode ---------------------------------------------
    def take_full_payload_packet(self) -> dict[str, Any]:
        """Leader, lock held: arrived payloads not yet published, plus drops for followers."""
        payloads = {}
        for state in self._registry.signalled():
            if state.awaiting_publish:
                state.awaiting_publish = False
                payloads[state.request_id] = self._packed(state)
        self.unpublished = 0
        dropped = [list(d) for d in self._registry.outbox.dropped_for_followers]
        self._registry.outbox.dropped_for_followers.clear()
        return {"payloads": payloads, "dropped": dropped}

    def publish_full_payloads(self, packet: dict[str, Any], *, leader: bool) -> dict[str, Any]:
        """Every rank, lock held: make the packet's payloads visible and return them."""
        if not leader:
            self._apply_drops(packet.get("dropped", ()))
        results: dict[str, Any] = {}
        for rid, payload in packet.get("payloads", {}).items():
            state = self._registry.ensure(rid)
            for entry in state.inputs:
                self._registry.set_registered(entry, False)
                entry.payload_arrived = True
            self._unpacked(state, payload)
            state.stage_recv = True
            if self.fan_in:
                state.metadata = None
                for entry in state.inputs:
                    self._note_metadata(state, entry.cached)
                results[rid] = {int(k): shallow_copy(v) for k, v in payload.items()}
            else:
                state.metadata = scheduling_metadata(payload) or None
                results[rid] = shallow_copy(payload)
            self._registry.signal(state)
        return results

    # -- model thread: streaming mode ----------------------------------------------------
    def ready_payloads(self) -> dict[str, Any]:
        """Lock held: copies of the payloads of requests woken since the last collect (fan-in: of the woken sources).

        The section dicts are copied too: the cache shares them with the stream's
        accumulation, so a runner editing a section of its copy would otherwise
        change what the next chunk is merged into.
        """
        if not self.fan_in:
            out = {}
            for s in self._registry.signalled_iter():
                if s.wake:
                    entry = s.inputs[0]
                    if entry.has_cached:
                        cached = entry.settle_cached()
                        out[s.request_id] = _copy_sections(cached) if type(cached) is dict else shallow_copy(cached)
            return out
        fanned: dict[str, Any] = {}
        for s in self._registry.signalled_iter():
            if s.wake:
                got = {e.source: _copy_payload(e.settle_cached()) for e in s.inputs if e.wake and e.has_cached}
                if got:
                    fanned[s.request_id] = got
        return fanned

    def take_stream_packet(self, *, with_payloads: bool) -> dict[str, Any]:
        """Lock held: drain wake/finish/metadata flags into a packet.

        ``with_payloads`` (the TP leader in streaming mode) also stages the
        changed payloads and the drops followers must mirror.
        """
        woken: list[str] = []
        finished: list[str] = []
        staged: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        sources: dict[str, list[list[int]]] = {}
        for state in self._registry.signalled():
            if with_payloads and state.has_cached and (state.updated or state.wake or state.finish_signal or state.metadata is not None):
                staged[state.request_id] = self._packed(state)
            ready_src, finished_src = _take_flags(state, woken.append, finished.append, metadata, per_source=self.fan_in)
            if ready_src or finished_src:
                sources[state.request_id] = [sorted(ready_src), sorted(finished_src)]
        dropped: list[list[str]] = []
        if with_payloads:
            dropped = [list(d) for d in self._registry.outbox.dropped_for_followers]
            self._registry.outbox.dropped_for_followers.clear()
        return {"woken": woken, "finished": finished, "metadata": metadata, "staged": staged, "dropped": dropped, "sources": sources}

    def drain_signals(self) -> tuple[set[str], set[str], dict[str, Any], set[str], bool, dict[str, set[int]], dict[str, set[int]]]:
        """Single rank, lock held: :meth:`take_stream_packet` (without payloads), the ``stage_recv``
        flags and the settling of the signalled index, in one pass over the signalled states.

        Returns ``(woken, finished, metadata, stage_recv, still_pending, ready_sources, finished_sources)``;
        ``still_pending`` says a state keeps a signal for a later collect (a full payload not yet published);
        the two per-source maps are filled on a fan-in stage only.
        """
        woken: set[str] = set()
        finished: set[str] = set()
        stage_recv: set[str] = set()
        metadata: dict[str, Any] = {}
        ready_sources: dict[str, set[int]] = {}
        finished_sources: dict[str, set[int]] = {}
        registry = self._registry
        pending = False
        fan_in = self.fan_in
        for state in registry.take_signalled():
            if state.stage_recv:
                stage_recv.add(state.request_id)
                state.stage_recv = False
            ready_src, finished_src = _take_flags(state, woken.add, finished.add, metadata, per_source=fan_in)
            if ready_src:
                ready_sources[state.request_id] = ready_src
            if finished_src:
                finished_sources[state.request_id] = finished_src
            if state.has_pending_signal():  # what a collect leaves set (a full payload not yet published)
                registry.signal(state)
                pending = True
        return woken, finished, metadata, stage_recv, pending, ready_sources, finished_sources

    def apply_stream_packet(self, packet: dict[str, Any]) -> None:
        """Follower, lock held: mirror what the leader received."""
        self._apply_drops(packet.get("dropped", ()))
        for rid, payload in packet.get("staged", {}).items():
            self._unpacked(self._registry.ensure(rid), payload)
        for rid, (_, finished_src) in packet.get("sources", {}).items():
            state = self._registry.ensure(rid)
            for entry in state.inputs:
                if entry.source in finished_src:
                    entry.stream_finished = True
                    entry.merged = None
                    self._registry.set_registered(entry, False)
        for rid in packet.get("finished", ()):
            state = self._registry.ensure(rid)
            for entry in state.inputs:
                entry.stream_finished = True
                entry.merged = None
                self._registry.set_registered(entry, False)

    def _apply_drops(self, dropped: Any) -> None:
        outbox = self._registry.outbox
        for rid, why in dropped:
            (outbox.timed_out if why == "timed_out" else outbox.failed).add(rid)
            state = self._registry.get(rid)
            if state is not None:
                if why == "timed_out":
                    outbox.missing[rid] = state.missing_sources()
                self._registry.release(state)


def _copy_payload(payload: Any) -> Any:
    return _copy_sections(payload) if type(payload) is dict else shallow_copy(payload)


def _take_flags(
    state: RequestState, add_woken: Callable[[str], Any], add_finished: Callable[[str], Any], metadata: dict[str, Any], *, per_source: bool
) -> tuple[set[int], set[int]]:
    """Move ``state``'s wake / finish / metadata signals out (lock held); a finished stream drops its accumulation.

    Returns the sources that woke and that finished (``per_source``, a fan-in stage; else two empty sets).
    """
    rid = state.request_id
    if state.wake:
        add_woken(rid)
    if state.finish_signal:
        add_finished(rid)
    if state.metadata is not None:
        metadata[rid] = state.metadata
    ready_src: set[int] = set()
    finished_src: set[int] = set()
    for entry in state.inputs:
        if per_source:
            if entry.wake:
                ready_src.add(entry.source)
            if entry.finish_signal:
                finished_src.add(entry.source)
        if entry.finish_signal and entry.has_cached:
            entry.merged = None  # the stream is over: release the accumulation buffer
        entry.wake = entry.finish_signal = False
    state.wake = state.finish_signal = state.updated = False
    state.metadata = None
    return ready_src, finished_src
