"""KV between TP stages in real processes over the shared-memory connector (each rank a process)."""

from __future__ import annotations

import queue
from typing import Any

import pytest

from omni_plugins.kv.testing import run_receiver_rank, run_sender_rank
from omni_plugins.testing.processes import process_context

shm_testing = pytest.importorskip("omni_plugins_shm.testing")

HEADS = 8
REQUESTS = ["req-a", "req-b", "req-c"]


def _context() -> Any:
    """Fresh processes from the test session's fork server (``omni_plugins.testing.processes``)."""
    return process_context()


@pytest.mark.parametrize(("from_tp", "to_tp"), [(2, 1), (1, 2)])
def test_kv_between_tp_stages_over_shm(from_tp: int, to_tp: int) -> None:
    ns = shm_testing.unique_namespace("kv")
    config = shm_testing.shm_config(ns)
    ctx = _context()
    results: Any = ctx.Queue()
    done = ctx.Event()
    senders = [
        ctx.Process(target=run_sender_rank, args=("shm", config, from_tp, to_tp, r, REQUESTS, HEADS, results, done), daemon=True)
        for r in range(from_tp)
    ]
    receivers = [
        ctx.Process(target=run_receiver_rank, args=("shm", config, from_tp, to_tp, r, REQUESTS, HEADS, results), daemon=True)
        for r in range(to_tp)
    ]
    procs = receivers + senders  # receivers first: they block in get until the shards appear
    try:
        for p in procs:
            p.start()
        sent: dict[int, tuple[list[str], list[str]]] = {}
        received: dict[tuple[int, str], tuple[list[str], dict[str, Any]]] = {}
        while len(sent) < from_tp or len(received) < to_tp * len(REQUESTS):
            try:
                msg = results.get(timeout=90)
            except queue.Empty:
                pytest.fail(f"children stalled: sent={sorted(sent)} received={sorted(received)} exit codes={[p.exitcode for p in procs]}")
            if msg[0] == "sent":
                sent[msg[1]] = (msg[2], msg[3])
            else:
                received[(msg[1], msg[2])] = (msg[3], msg[4])
        for rank, (ids, failed) in sent.items():
            assert ids == REQUESTS and failed == [], f"sender {rank}"
        for (rank, rid), (problems, meta) in received.items():
            assert problems == [], f"receiver {rank} {rid}: {problems}"
            assert meta["request_id"] == rid
            if from_tp > to_tp:
                assert meta["merged_remote_rank_count"] == from_tp // to_tp
            else:
                assert meta["sliced_for_local_rank"] == rank
        for p in receivers:
            p.join(60)
        done.set()
        for p in senders:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        done.set()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
        results.close()
    shm_testing.assert_namespace_empty(ns)
