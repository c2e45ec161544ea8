"""Entry point of the TP=2 consumer ranks in the real-process TP test (spawned; imported by path).

Rank 0 of the consumer stage also hosts the producer stage (memory connector,
same process), receives from the connector and broadcasts over gloo; rank 1
never touches the connector for ordinary payloads and must see the same
payloads through the broadcast.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from omni_plugins import StageConfig
from omni_plugins.runtime import StageTransferRuntime, TorchDistributedGroup


class _Req:
    def __init__(self, rid: str, done: bool = False) -> None:
        self.request_id = rid
        self.external_req_id = rid
        self.done = done

    def is_finished(self) -> bool:
        return self.done


def _digest(payload: Any) -> Any:
    if isinstance(payload, torch.Tensor):
        return payload.tolist()
    if isinstance(payload, dict):
        return {k: _digest(v) for k, v in sorted(payload.items())}
    if isinstance(payload, list):
        return [_digest(v) for v in payload]
    return payload


def rank_main(rank: int, port: int, scenarios: list[tuple[str, str, str]], n: int, chunks: int, out: Any) -> None:
    """Run every ``(namespace, mode, codec)`` scenario in turn over one gloo group (spawning is the slow part)."""
    store = dist.TCPStore("127.0.0.1", port, None, False)  # the test process serves it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        for namespace, mode, codec in scenarios:
            _scenario(rank, namespace, mode, codec, n, chunks, out)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _scenario(rank: int, namespace: str, mode: str, codec: str, n: int, chunks: int, out: Any) -> None:
    group = TorchDistributedGroup(codec=codec)  # type: ignore[arg-type]
    conn = {"name": "memory", "extra": {"namespace": namespace}}
    stream = mode == "stream"
    consumer = StageTransferRuntime(StageConfig(stage_id=1, tp_size=2, async_chunk=stream), conn, tp_group=group)
    producer = None
    if rank == 0:
        producer = StageTransferRuntime(
            StageConfig(stage_id=0, async_chunk=stream, custom_process_next_stage_input_func="rt_builders.stream" if stream else None),
            conn,
        )
    ids = [f"req{i}" for i in range(n)]
    for rid in ids:
        consumer.register_chunk_recv(_Req(rid))
    seen: dict[str, Any] = {}
    done: set[str] = set()
    ready_order: list[list[str]] = []
    deadline = time.monotonic() + 60
    step = 0
    while len(done) < n and time.monotonic() < deadline:
        if producer is not None:
            if stream and step < chunks:
                for rid in ids:
                    producer.send_chunk(_Req(rid, done=step == chunks - 1), {"embed": {"decode": torch.full((1, 2), float(step))}})
            elif not stream and step == 0:
                producer.send_full_payload_outputs({rid: {"x": torch.arange(3) + i, "name": rid} for i, rid in enumerate(ids)})
        if stream:
            sig = consumer.collect_signals()
            for rid in sorted(sig.chunk_ready):
                seen[rid] = _digest(consumer.get_local_stage_payload(rid))
            done |= sig.chunk_finished
            ready_order.append(sorted(sig.chunk_ready))
        else:
            got = consumer.recv_full_payload_inputs()
            for rid, payload in got.items():
                seen[rid] = _digest(payload)
            sig = consumer.collect_signals()
            assert sig.stage_recv == set(got)
            done |= set(got)
            ready_order.append(sorted(got))
        step += 1
        time.sleep(0.005)
    out.put((mode, codec, rank, sorted(done), seen, ready_order, consumer.arrival_mode))
    if producer is not None:
        producer.wait_sends()
    for rid in ids:
        consumer.cleanup_finished_request(rid)
        if producer is not None:
            producer.cleanup_finished_request(rid)
    leftover = consumer.active_request_count() + (producer.active_request_count() if producer else 0)
    keys = producer.connector.keys() if producer is not None else []  # type: ignore[union-attr]
    out.put((mode, codec, rank, "leftover", leftover, keys))
    consumer.shutdown()
    if producer is not None:
        producer.shutdown()
