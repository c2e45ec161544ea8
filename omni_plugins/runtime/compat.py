"""Mapping views that payload builders written for the reference runtime use.

Builders receive the runtime as ``transfer_manager`` and may read
``transfer_manager.put_req_chunk[ext_id]`` (chunks sent so far),
``transfer_manager.request_payload[ext_id]`` (the accumulated received
chunks) or append to ``transfer_manager.code_prompt_token_ids[ext_id]``. These
views read and write the single :class:`RequestState` of each request; they are
keyed by external id (internal ids work too).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from omni_plugins.runtime.state import RequestRegistry, RequestState


class _View(Mapping[str, Any]):
    def __init__(self, registry: RequestRegistry) -> None:
        self._registry = registry

    def _state(self, key: str) -> RequestState:
        state = self._registry.get(key)
        if state is None or state.released:
            raise KeyError(key)
        return state

    def __iter__(self) -> Iterator[str]:
        return iter([s.external_id for s in self._registry if not s.released])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class PutChunkView(_View):
    """``ext_id -> number of chunks enqueued so far`` (0 for unknown ids, like a defaultdict)."""

    def __getitem__(self, key: str) -> int:
        try:
            return self._state(key).next_send_chunk
        except KeyError:
            return 0


class RequestPayloadView(_View, MutableMapping[str, Any]):
    """``ext_id -> accumulated received chunks`` ("ar" workers; ``{source_stage: chunks}`` on a fan-in stage)."""

    def __getitem__(self, key: str) -> Any:
        with self._registry.lock:
            state = self._state(key)
            for entry in state.inputs:
                entry.settle_cached()  # joins what the lazy merge left pending, in the sections ``merged`` shares
            if len(state.inputs) > 1:  # fan-in: per source
                merged: Any = {e.source: e.merged for e in state.inputs if e.merged is not None} or None
            else:
                merged = state.inputs[0].merged if state.inputs else None
        if merged is None:
            raise KeyError(key)
        return merged

    def __setitem__(self, key: str, value: Any) -> None:
        state = self._state(key)
        if len(state.inputs) > 1:
            for entry in state.inputs:
                entry.merged = value.get(entry.source)
        elif state.inputs:
            state.inputs[0].merged = value

    def __delitem__(self, key: str) -> None:
        for entry in self._state(key).inputs:
            entry.merged = None

    def __iter__(self) -> Iterator[str]:
        return iter([s.external_id for s in self._registry if any(i.merged is not None for i in s.inputs) and not s.released])


class CodePromptView(_View, MutableMapping[str, Any]):
    """``ext_id -> list`` builder scratch, created on first access for known requests."""

    def __getitem__(self, key: str) -> list[Any]:
        return self._state(key).code_prompt_token_ids

    def __setitem__(self, key: str, value: Any) -> None:
        self._state(key).code_prompt_token_ids = list(value)

    def __delitem__(self, key: str) -> None:
        self._state(key).code_prompt_token_ids = []
