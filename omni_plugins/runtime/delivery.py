"""Receive-side semantics: what an arrival does to a request, and what the model thread sees.

The receive thread calls :class:`Delivery` (as its ArrivalHandler) under the
registry lock, then :meth:`Delivery.publish` once per batch of arrivals; the runtime calls the ``take_*``/``apply_*`` methods on the
model thread. Packets exchanged between TP ranks are plain dicts of lists so
they can be wire-encoded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from omni_plugins.runtime.accumulate import merge_chunk
from omni_plugins.runtime.consumable import chunk_flags, has_content, payload_audio_codes, payload_is_consumable, scheduling_metadata
from omni_plugins.runtime.state import RequestRegistry, RequestState
from omni_plugins.runtime.wakeflag import WakeFlag

logger = logging.getLogger(__name__)


def shallow_copy(payload: Any) -> Any:
    return dict(payload) if isinstance(payload, dict) else payload


def _copy_sections(payload: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``payload`` and of each of its section dicts (values are shared)."""
    return {k: dict(v) if type(v) is dict or isinstance(v, dict) else v for k, v in payload.items()}


class Delivery:
    """Receive-side rules for one stage (full-payload or streaming, ``ar`` or ``generation``)."""

    def __init__(
        self,
        registry: RequestRegistry,
        *,
        from_stage: int,
        async_chunk: bool,
        worker_type: str,
        recv_timeout_s: float,
        abort_scan_limit: int,
        multi_rank: bool,
    ) -> None:
        self._registry = registry
        self.from_stage = from_stage
        self.async_chunk = async_chunk
        self.worker_type = worker_type
        self.recv_timeout_s = recv_timeout_s
        self._scan = abort_scan_limit
        self._multi_rank = multi_rank
        #: set whenever the model thread has something to pick up (see ``wait_ready``)
        self.ready = WakeFlag()
        #: full payloads arrived and not yet published (read without the lock for a fast path)
        self.unpublished = 0
        self._ready_due = False  # something was delivered since the last publish()

    # -- keys -------------------------------------------------------------------
    def recv_key(self, state: RequestState) -> str:
        return f"{state.external_id}_{self.from_stage}_{state.next_recv_chunk}"

    def abort_keys(self, state: RequestState) -> list[str]:
        """Keys of chunks that may have been put for ``state`` but will never be read."""
        if not state.registered:
            return []
        first = state.next_recv_chunk
        return [f"{state.external_id}_{self.from_stage}_{i}" for i in range(first, first + self._scan)]

    # -- ArrivalHandler (receive thread, lock held) -------------------------------
    def pollable(self, state: RequestState) -> bool:
        if not self.async_chunk or self.worker_type == "ar":
            return True
        # generation workers keep one chunk in flight: the previous one must reach
        # the scheduler (signals collected) and the runner (cache consumed) first
        if state.wake or state.metadata is not None:
            return False
        return not (state.has_cached and payload_is_consumable(state.cached))

    def on_payload(self, state: RequestState, payload: Any) -> None:
        """One arrival. Raises (state unchanged as far as the stream position goes) when the payload
        breaks the payload rules; the receive thread then reports the request failed."""
        if self.async_chunk:
            self._on_chunk(state, payload)
        else:
            self._on_full_payload(state, payload)
        now = time.monotonic()
        if state.next_recv_chunk:  # registration -> first chunk is prefill time, not a chunk gap
            gap = now - state.last_arrival
            state.arrival_gap = gap if not state.arrival_gap else 0.7 * state.arrival_gap + 0.3 * gap
        state.next_recv_chunk += 1
        state.last_arrival = now
        if state.deadline is not None:  # a finished stream or an arrived full payload waits no more
            state.deadline = now + self.recv_timeout_s
        self._registry.touch(state)

    def on_failure(self, state: RequestState, *, timed_out: bool) -> list[str]:
        keys = self.abort_keys(state)
        outbox = self._registry.outbox
        (outbox.timed_out if timed_out else outbox.failed).add(state.request_id)
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

    def _on_chunk(self, state: RequestState, chunk: Any) -> None:
        # runs for every chunk on the receive thread: each type test once, both predicates in one pass
        is_dict = type(chunk) is dict or isinstance(chunk, dict)
        if is_dict:
            finished, consumable = chunk_flags(chunk)
        else:
            finished, consumable = False, chunk is not None  # what payload_finished says of a non-dict
        data: Any
        if is_dict and self.worker_type == "ar":
            # a new dict (copied into the cache below); tensors to concatenate are left pending: joined
            # once, on the thread that reads the payload (``RequestState.settle_cached``)
            state.merged = data = merge_chunk(state.merged, chunk, lazy=True)
            state.pending_cat = True
        else:
            if self.worker_type == "generation" and not finished and not has_content(payload_audio_codes(chunk)):
                logger.debug("request %s: chunk without audio codes ignored", state.request_id)
                return
            data = chunk
        cached = state.cached
        if is_dict and state.has_cached and isinstance(cached, dict):
            cached.update(data)
        else:
            state.set_cached(shallow_copy(data))
        state.updated = True
        state.metadata = scheduling_metadata(state.cached) or state.metadata
        if consumable or finished:
            state.wake = True
        if finished:
            state.finish_signal = True
            state.stream_finished = True
            state.deadline = None
            self._registry.set_registered(state, False)
        self._registry.signal(state)
        self._ready_due = True

    def _on_full_payload(self, state: RequestState, payload: Any) -> None:
        inputs = payload.get("engine_inputs", payload) if isinstance(payload, dict) else payload
        state.set_cached(shallow_copy(inputs))
        state.awaiting_publish = True
        self.unpublished += 1
        state.payload_arrived = True
        state.deadline = None
        self._registry.set_registered(state, False)
        self._registry.signal(state)
        self._ready_due = True

    # -- model thread: full-payload mode ---------------------------------------------
    def take_full_payload_packet(self) -> dict[str, Any]:
        """Leader, lock held: arrived payloads not yet published, plus drops for followers."""
        payloads = {}
        for state in self._registry.signalled():
            if state.awaiting_publish:
                state.awaiting_publish = False
                payloads[state.request_id] = shallow_copy(state.cached)
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
            self._registry.set_registered(state, False)
            state.payload_arrived = True
            state.set_cached(payload)
            state.stage_recv = True
            state.metadata = scheduling_metadata(payload) or None
            self._registry.signal(state)
            results[rid] = shallow_copy(payload)
        return results

    # -- model thread: streaming mode ----------------------------------------------------
    def ready_payloads(self) -> dict[str, Any]:
        """Lock held: copies of the payloads of requests woken since the last collect.

        The section dicts are copied too: the cache shares them with the stream's
        accumulation, so a runner editing a section of its copy would otherwise
        change what the next chunk is merged into.
        """
        return {
            s.request_id: _copy_sections(cached) if type(cached := s.settle_cached()) is dict else shallow_copy(cached)
            for s in self._registry.signalled_iter()
            if s.wake and s.has_cached
        }

    def take_stream_packet(self, *, with_payloads: bool) -> dict[str, Any]:
        """Lock held: drain wake/finish/metadata flags into a packet.

        ``with_payloads`` (the TP leader in streaming mode) also stages the
        changed payloads and the drops followers must mirror.
        """
        woken: list[str] = []
        finished: list[str] = []
        staged: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for state in self._registry.signalled():
            if with_payloads and state.has_cached and (state.updated or state.wake or state.finish_signal or state.metadata is not None):
                staged[state.request_id] = shallow_copy(state.settle_cached())
            _take_flags(state, woken.append, finished.append, metadata)
        dropped: list[list[str]] = []
        if with_payloads:
            dropped = [list(d) for d in self._registry.outbox.dropped_for_followers]
            self._registry.outbox.dropped_for_followers.clear()
        return {"woken": woken, "finished": finished, "metadata": metadata, "staged": staged, "dropped": dropped}

    def drain_signals(self) -> tuple[set[str], set[str], dict[str, Any], set[str], bool]:
        """Single rank, lock held: :meth:`take_stream_packet` (without payloads), the ``stage_recv``
        flags and the settling of the signalled index, in one pass over the signalled states.

        Returns ``(woken, finished, metadata, stage_recv, still_pending)``; ``still_pending``
        says a state keeps a signal for a later collect (a full payload not yet published).
        """
        woken: set[str] = set()
        finished: set[str] = set()
        stage_recv: set[str] = set()
        metadata: dict[str, Any] = {}
        registry = self._registry
        pending = False
        for state in registry.take_signalled():
            if state.stage_recv:
                stage_recv.add(state.request_id)
                state.stage_recv = False
            _take_flags(state, woken.add, finished.add, metadata)
            if state.has_pending_signal():  # what a collect leaves set (a full payload not yet published)
                registry.signal(state)
                pending = True
        return woken, finished, metadata, stage_recv, pending

    def apply_stream_packet(self, packet: dict[str, Any]) -> None:
        """Follower, lock held: mirror what the leader received."""
        self._apply_drops(packet.get("dropped", ()))
        for rid, payload in packet.get("staged", {}).items():
            self._registry.ensure(rid).set_cached(payload)
        for rid in packet.get("finished", ()):
            state = self._registry.ensure(rid)
            state.stream_finished = True
            state.merged = None
            self._registry.set_registered(state, False)

    def _apply_drops(self, dropped: Any) -> None:
        outbox = self._registry.outbox
        for rid, why in dropped:
            (outbox.timed_out if why == "timed_out" else outbox.failed).add(rid)
            state = self._registry.get(rid)
            if state is not None:
                self._registry.release(state)


def _take_flags(state: RequestState, add_woken: Callable[[str], Any], add_finished: Callable[[str], Any], metadata: dict[str, Any]) -> None:
    """Move ``state``'s wake / finish / metadata signals out (lock held); a finished stream drops its accumulation."""
    rid = state.request_id
    if state.wake:
        add_woken(rid)
    if state.finish_signal:
        add_finished(rid)
        if state.has_cached:
            state.merged = None  # the stream is over: release the accumulation buffer
    if state.metadata is not None:
        metadata[rid] = state.metadata
    state.wake = state.finish_signal = state.updated = False
    state.metadata = None
