"""The runtime's KV side: delegation to the KV transfer manager, the KV lifecycle, rank helpers.

The KV manager (:mod:`omni_plugins.kv`) moves rank-sharded caches; this
module adds what the scheduler-facing runtime owns: the per-request lifecycle
pending -> active -> completed (stored on :class:`RequestState`) and the
rank-routing helpers of the reference API, which delegate to
:mod:`omni_plugins.kv.ranks`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from omni_plugins.kv import ranks
from omni_plugins.kv.shards import merge_shards, slice_for_rank
from omni_plugins.runtime.state import KVPhase, RequestRegistry, RequestState

logger = logging.getLogger(__name__)


def _pure_kv(state: RequestState) -> bool:
    """A state that exists only for the KV lifecycle and can go once that is over."""
    return (
        state.kv_phase is KVPhase.NONE
        and not state.kv_triggered
        and not any(state.sent)
        and not any(i.next_recv_chunk or i.has_cached or i.stream_finished or i.payload_arrived for i in state.inputs)
        and state.in_flight == 0
        and state.full_payload is None
        and not state.has_undelivered_input()
    )


class KVBridge:
    """KV delegation and lifecycle for one runtime.

    ``manager`` receives (and, on a stage with one KV edge, also sends);
    ``send_managers`` are the managers of the KV output edges when they are
    not ``manager`` itself: a fanning-out stage sends every KV transfer on
    each of them (one manager per connector instance, covering every KV edge
    on it, so the KV is extracted and encoded once per connector).
    """

    def __init__(
        self,
        registry: RequestRegistry,
        manager: Any | None,
        *,
        from_tp: int,
        to_tp: int,
        local_rank: int,
        send_managers: list[Any] | None = None,
    ) -> None:
        self._registry = registry
        self.manager = manager
        self.send_managers: list[Any] = send_managers if send_managers is not None else ([manager] if manager is not None else [])
        self.from_tp, self.to_tp, self.local_rank = from_tp, to_tp, local_rank
        self._used = False  # the KV lifecycle was entered (mark/ack) at least once

    @property
    def managers(self) -> list[Any]:
        """Every distinct manager (the receiving one first)."""
        out = [self.manager] if self.manager is not None else []
        return out + [m for m in self.send_managers if m is not self.manager]

    # -- transfers ------------------------------------------------------------------
    def send(
        self,
        finished_reqs: Mapping[str, Mapping[str, Any]],
        kv_caches: Any,
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        if not self.send_managers:
            return list(finished_reqs) if finished_reqs else []
        sent: list[str] = []
        failed: list[str] = []
        for manager in self.send_managers:
            done = manager.handle_finished_requests_kv_transfer(
                finished_reqs=finished_reqs,
                kv_caches=kv_caches,
                block_size=block_size,
                cache_dtype=cache_dtype,
                request_id_resolver=request_id_resolver,
            )
            sent += [rid for rid in done or [] if rid not in sent]
            failed += list(getattr(manager, "drain_failed_sends", list)())
        with self._registry.lock:
            self._registry.outbox.kv_sent.extend(sent)
            self._registry.outbox.failed.update(failed)
        return sent

    def recv(self, request_id: str, target_device: Any = None) -> tuple[dict[str, Any] | None, int]:
        if self.manager is None:
            return None, 0
        result = self.manager.receive_kv_cache_for_request(request_id, target_device=target_device)
        return result if result is not None else (None, 0)

    def recv_companions(
        self, cfg_request_ids: Mapping[str, str], target_device: Any = None
    ) -> dict[str, tuple[dict[str, Any] | None, int]]:
        if self.manager is None:
            return {role: (None, 0) for role in cfg_request_ids}
        companion = getattr(self.manager, "receive_cfg_companion", None)
        if callable(companion):
            # one deadline for all roles: a missing companion costs one timeout, not one per role
            return dict(companion(cfg_request_ids, target_device=target_device))
        return {role: self.recv(rid, target_device) for role, rid in cfg_request_ids.items()}

    def recv_multi(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[..., Mapping[str, Any] | None] | None = None,
        target_device: Any = None,
        active_request_ids: Iterable[str] | None = None,
    ) -> bool:
        """Primary KV plus CFG companions (``req.sampling_params.cfg_kv_request_ids``)."""
        if self.manager is None:
            return False
        request_id = getattr(req, "request_id", None)
        if not request_id:
            logger.warning("request has no request_id; cannot receive its KV cache")
            return False
        if active_request_ids is not None and request_id not in set(active_request_ids):
            logger.info("skip receiving KV cache for inactive request %s", request_id)
            return False
        ok = False
        data, _size = self.recv(request_id, target_device)
        if data:
            self.manager.apply_kv_cache_to_request(req, data)
            ok = True
        params = getattr(req, "sampling_params", None)
        cfg_ids = getattr(params, "cfg_kv_request_ids", None)
        if cfg_ids and cfg_kv_collect_func is not None:
            try:
                if _fetches_itself(cfg_kv_collect_func):  # vLLM-Omni's form: it receives the companions through the manager
                    collected = cfg_kv_collect_func(request_id, dict(cfg_ids), self.manager, target_device)
                else:
                    collected = cfg_kv_collect_func(request_id, self.recv_companions(cfg_ids, target_device))
                if collected and params is not None:
                    for key, value in collected.items():
                        setattr(params, key, value)
            except Exception:
                logger.exception("collecting CFG companion KV caches failed for %s", request_id)
        return ok

    def cleanup(self, request_id: str, *, aborted: bool) -> None:
        for manager in self.managers:
            try:
                manager.cleanup(request_id, drop_sent=aborted)
            except TypeError:
                manager.cleanup(request_id)
            except Exception:
                logger.warning("KV cleanup of %s failed", request_id, exc_info=True)

    # -- lifecycle (lock held by the caller) -------------------------------------------
    def mark(self, req_id: str, seq_len: int, block_ids: list[int], custom_metadata: dict[str, Any] | None) -> bool:
        state = self._registry.ensure(req_id)
        self._used = True
        if state.kv_phase in (KVPhase.PENDING, KVPhase.ACTIVE):
            return False  # dedup: already on its way
        transfer: dict[str, Any] = {"seq_len": seq_len, "block_ids": list(block_ids)}
        if custom_metadata is not None:
            transfer["custom_metadata"] = custom_metadata
        state.kv_transfer, state.kv_phase, state.kv_triggered = transfer, KVPhase.PENDING, True
        return True

    def drain_pending(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for state in self._registry:
            if state.kv_phase is KVPhase.PENDING and state.kv_transfer is not None:
                out[state.request_id] = dict(state.kv_transfer)
                state.kv_phase = KVPhase.ACTIVE
        return out

    def ack(self, req_ids: Iterable[str]) -> None:
        self._used = True
        for rid in req_ids:
            state = self._registry.get(rid) or self._registry.ensure(rid)
            state.kv_phase = KVPhase.COMPLETED

    def drain_completed(self) -> set[str]:
        done: set[str] = set()
        for state in self._registry:
            if state.kv_phase is KVPhase.COMPLETED:
                done.add(state.request_id)
                state.kv_phase, state.kv_transfer = KVPhase.NONE, None
                if _pure_kv(state):
                    self._registry.drop(state)
        return done

    def triggered(self, req_id: str) -> bool:
        state = self._registry.get(req_id)
        return state is not None and state.kv_triggered

    def has_pending_work(self) -> bool:
        """Any request in the KV lifecycle (a per-step call: free until the lifecycle is first used)."""
        return self._used and any(s.kv_phase is not KVPhase.NONE for s in self._registry)

    # -- rank routing -------------------------------------------------------------------
    def remote_ranks(self) -> list[int]:
        return ranks.remote_ranks_for_recv(self.from_tp, self.to_tp, self.local_rank)

    def target_ranks(self) -> list[int]:
        return ranks.target_ranks_for_send(self.from_tp, self.to_tp, self.local_rank)

    def recv_keys(self, req_id: str, from_stage: int, chunk_id: int = 0) -> list[str]:
        return [ranks.kv_key(req_id, from_stage, chunk_id, r, self.local_rank) for r in self.remote_ranks()]

    def send_keys(self, req_id: str, from_stage: int, chunk_id: int = 0) -> list[str]:
        return [ranks.kv_key(req_id, from_stage, chunk_id, self.local_rank, r) for r in self.target_ranks()]

    def merge(self, payloads: list[dict[str, Any]]) -> dict[str, Any] | None:
        shards = [p for p in payloads if isinstance(p, dict)]
        return merge_shards(shards) if shards else None

    def slice(self, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        if payload is None:
            return None
        return slice_for_rank(payload, self.from_tp, self.to_tp, self.local_rank)


@functools.lru_cache(maxsize=64)
def _fetches_itself(func: Callable[..., Any]) -> bool:
    """Whether a CFG collect function has vLLM-Omni's signature ``(request_id, cfg_request_ids, kv_transfer_manager,
    target_device)`` (it fetches each companion's KV with ``kv_transfer_manager.receive_kv_cache_for_request``) rather
    than ``(request_id, {role: (payload, size)})`` (it is given the companions' KV)."""
    try:
        params = [p for p in inspect.signature(func).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 3
