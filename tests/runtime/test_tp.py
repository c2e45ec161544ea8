"""TP=2 consumer in real processes (gloo over 127.0.0.1): rank 0 receives and broadcasts,
rank 1 sees the same payloads at the same step. Plus in-process tests of the fan-out rules."""

from __future__ import annotations

import copy
import threading
import uuid
from typing import Any

import torch
from rt_helpers import Req, make_runtime, wait_until

from omni_plugins import StageConfig
from omni_plugins.pipeline.local import rendezvous_store
from omni_plugins.runtime import StageTransferRuntime
from omni_plugins.testing.processes import process_context

SCENARIOS = [("full", "wire"), ("stream", "wire"), ("stream", "pickle")]


def test_tp2_leader_receives_and_broadcasts() -> None:
    import tp_worker

    ctx = process_context()
    out = ctx.Queue()
    store = rendezvous_store()  # served here, bound before the ranks start: no port to race for
    port = int(store.port)
    scenarios = [(f"tp-{uuid.uuid4().hex[:8]}", mode, codec) for mode, codec in SCENARIOS]
    n, chunks = 6, 3
    procs = [ctx.Process(target=tp_worker.rank_main, args=(r, port, scenarios, n, chunks, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict = {}
    leftovers: dict = {}
    try:
        for _ in range(4 * len(SCENARIOS)):
            item = out.get(timeout=120)
            if item[3] == "leftover":
                leftovers[item[:3]] = item[4:]
            else:
                results[item[:3]] = item[3:]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for mode, codec in SCENARIOS:
        done0, seen0, order0, arrival0 = results[(mode, codec, 0)]
        done1, seen1, order1, arrival1 = results[(mode, codec, 1)]
        assert done0 == done1 == sorted(f"req{i}" for i in range(n))
        assert seen0 == seen1  # identical payloads on both ranks
        assert order0 == order1  # ... visible at the same steps
        assert arrival0 == "block" and arrival1 is None  # only the leader runs a receive thread
        if mode == "full":
            assert seen0["req2"] == {"name": "req2", "x": [2, 3, 4]}
        else:
            assert seen0["req0"]["embed"]["decode"] == [[float(i)] * 2 for i in range(chunks)]
        assert leftovers[(mode, codec, 0)] == (0, []) and leftovers[(mode, codec, 1)] == (0, [])


class _Hub:
    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=10)
        self.slot: Any = None


class ThreadTPGroup:
    """In-process TP group over threads (unit tests of the fan-out rules only)."""

    def __init__(self, hub: _Hub, rank: int, size: int) -> None:
        self.hub, self.rank_in_group, self.world_size = hub, rank, size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.rank_in_group == src:
            self.hub.slot = obj
        self.hub.barrier.wait()
        value = self.hub.slot if self.rank_in_group == src else copy.deepcopy(self.hub.slot)
        self.hub.barrier.wait()
        return value


def _in_lockstep(fns: list) -> list:
    results: list = [None] * len(fns)
    errors: list = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return results


def test_timeouts_reach_followers(namespace: str) -> None:
    hub = _Hub(2)
    conn = {"name": "memory", "extra": {"namespace": namespace}}
    ranks = [
        StageTransferRuntime(StageConfig(stage_id=1, tp_size=2, recv_timeout_s=0.05), conn, tp_group=ThreadTPGroup(hub, r, 2)) for r in range(2)
    ]
    try:
        for rt in ranks:
            rt.register_chunk_recv(Req("r"))
        wait_until(lambda: ranks[0].active_request_count() == 0)  # leader timed it out
        assert ranks[1].active_request_count() == 1  # follower still holds it ...
        _in_lockstep([rt.recv_full_payload_inputs for rt in ranks])  # ... until the next packet
        sigs = [rt.collect_signals() for rt in ranks]
        assert all(s.timed_out == {"r"} for s in sigs)
        assert ranks[1].active_request_count() == 0
    finally:
        for rt in ranks:
            rt.shutdown()


def test_follower_never_sends_or_receives(namespace: str) -> None:
    hub = _Hub(2)
    conn = {"name": "memory", "extra": {"namespace": namespace}}
    follower = StageTransferRuntime(
        StageConfig(stage_id=1, async_chunk=True, custom_process_next_stage_input_func="rt_builders.stream"), conn, tp_group=ThreadTPGroup(hub, 1, 2)
    )
    p = make_runtime(0, namespace, async_chunk=True, custom_process_next_stage_input_func="rt_builders.stream")
    try:
        assert not follower.is_data_transfer_rank() and follower.arrival_mode is None
        assert follower.send_chunk(Req("r"), {"x": torch.ones(1)}) is True
        follower.wait_sends()
        assert follower.connector.keys() == []
        follower.register_chunk_recv(Req("r"))
        p.send_chunk(Req("r"), {"x": [1]})
        p.wait_sends()
        assert follower.connector.keys() == ["r_0_0"]  # nobody on the follower took it
    finally:
        follower.shutdown()
        p.shutdown()
