"""The per-cycle report a runtime hands to its scheduler.

The runtime never touches a scheduler; once per model step the runner calls
:meth:`StageTransferRuntime.collect_signals` and forwards this object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ConnectorSignals:
    """What changed since the previous ``collect_signals`` call.

    Attributes:
        chunk_ready: requests woken by a consumable chunk (or a stream end) -- streaming mode.
        chunk_finished: requests whose input stream ended (``meta.finished``).
        request_metadata: scheduling metadata per request (``next_stage_prompt_len``,
            ``code_predictor_codes``, ``left_context_size``).
        kv_sent: requests whose KV cache was handed to the connector.
        stage_recv: requests whose full payload became visible on this rank.
        has_pending_kv_work: any KV transfer is pending, active or awaiting its drain.
        failed: requests the runtime gave up on (send dropped after retries, builder
            crash, undecodable payload); their state is gone.
        timed_out: requests that waited longer than ``recv_timeout_s`` for input; their
            state is gone.
        chunk_ready_sources: fan-in stages: per request in ``chunk_ready``, the source
            stages whose chunk woke it.
        chunk_finished_sources: fan-in stages: per request, the source stages whose
            stream ended this step (``chunk_finished`` lists a request once every source's has).
        missing_sources: per request in ``timed_out``, the source stages it was still
            waiting for.
    """

    chunk_ready: set[str] = field(default_factory=set)
    chunk_finished: set[str] = field(default_factory=set)
    request_metadata: dict[str, dict[str, Any]] = field(default_factory=dict)
    kv_sent: list[str] = field(default_factory=list)
    stage_recv: set[str] = field(default_factory=set)
    has_pending_kv_work: bool = False
    failed: set[str] = field(default_factory=set)
    timed_out: set[str] = field(default_factory=set)
    chunk_ready_sources: dict[str, set[int]] = field(default_factory=dict)
    chunk_finished_sources: dict[str, set[int]] = field(default_factory=dict)
    missing_sources: dict[str, list[int]] = field(default_factory=dict)

    def has_signals(self) -> bool:
        """True when the scheduler has anything to act on."""
        return bool(
            self.chunk_ready
            or self.chunk_finished
            or self.request_metadata
            or self.kv_sent
            or self.stage_recv
            or self.has_pending_kv_work
            or self.failed
            or self.timed_out
            or self.chunk_finished_sources
        )

    __bool__ = has_signals

    # reference-compatible attribute names (``OmniConnectorOutput``)
    @property
    def chunk_ready_req_ids(self) -> set[str]:
        return self.chunk_ready

    @property
    def chunk_finished_req_ids(self) -> set[str]:
        return self.chunk_finished

    @property
    def kv_sent_req_ids(self) -> list[str]:
        return self.kv_sent

    @property
    def stage_recv_req_ids(self) -> set[str]:
        return self.stage_recv
