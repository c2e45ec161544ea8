"""Producer and consumer stages in separate processes over real backends (shm, Redis).

One spawned producer process serves every scenario of this module (spawning
and importing torch is the slow part); the pytest process is the consumer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from mp_producer import chunk_of, full_of
from rt_helpers import Req

from omni_plugins import StageConfig
from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime
from omni_plugins.testing.processes import process_context

N, CHUNKS = 50, 4


@pytest.fixture(scope="module")
def producer() -> Iterator[tuple[Any, Any]]:
    import mp_producer

    ctx = process_context()
    cmds, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=mp_producer.serve, args=(cmds, results), daemon=True)
    proc.start()
    yield cmds, results
    cmds.put(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _consume(name: str, config: dict[str, Any], producer: tuple[Any, Any]) -> None:
    cmds, results = producer
    conn = {"name": name, "extra": config}
    tuning = RuntimeTuning(join_timeout_s=5.0)
    stream = StageTransferRuntime(StageConfig(stage_id=1, async_chunk=True, recv_timeout_s=120), conn, tuning=tuning)
    whole = StageTransferRuntime(StageConfig(stage_id=1, recv_timeout_s=120), conn, tuning=tuning)
    try:
        assert stream.arrival_mode == "block"  # both backends can wait for a key
        # shm waits on every pending key at once; a connector without wait_any keeps parking on one
        assert stream.debug_state()["arrival_waits_any"] is stream.connector.capabilities.wait_any
        for i in range(N):
            stream.register_chunk_recv(Req(f"s{i}"))
            whole.register_chunk_recv(Req(f"f{i}"))
        cmds.put(("produce", name, config, N, CHUNKS))
        finished: set[str] = set()
        arrived: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        while (len(finished) < N or len(arrived) < N) and time.monotonic() < deadline:
            stream.wait_ready(0.05)
            sig = stream.collect_signals()
            assert not sig.failed and not sig.timed_out
            finished |= sig.chunk_finished
            arrived.update(whole.recv_full_payload_inputs())
            assert not whole.collect_signals().failed
        status = results.get(timeout=60)
        assert status[0] == "sent" and status[1], status
        assert len(finished) == N and len(arrived) == N
        for i in range(N):
            got = stream.get_local_stage_payload(f"s{i}")
            want = torch.cat([chunk_of(i, k)["embed"]["decode"] for k in range(CHUNKS)])
            assert torch.equal(got["embed"]["decode"], want), f"s{i}"
            assert got["ids"]["output"] == list(range(CHUNKS)) and got["meta"]["finished"] is True
            want_full = full_of(i)
            assert torch.equal(arrived[f"f{i}"]["hidden"], want_full["hidden"]) and arrived[f"f{i}"]["name"] == f"f{i}"
        for i in range(N):
            stream.cleanup_finished_request(f"s{i}")
            whole.cleanup_finished_request(f"f{i}")
        assert stream.active_request_count() == 0 and whole.active_request_count() == 0
    finally:
        stream.shutdown()
        whole.shutdown()
        cmds.put("close")
        closed = results.get(timeout=60)
    assert closed == ("closed", 0)


def test_streams_and_full_payloads_over_shm(producer: tuple[Any, Any]) -> None:
    pytest.importorskip("omni_plugins_shm")
    from omni_plugins_shm.testing import assert_namespace_empty

    ns = f"rt-{uuid.uuid4().hex[:10]}"
    _consume("shm", {"namespace": ns, "pool_bytes": 8 << 20}, producer)
    assert_namespace_empty(ns)


def test_streams_and_full_payloads_over_redis(producer: tuple[Any, Any]) -> None:
    pytest.importorskip("omni_plugins_redis")
    from omni_plugins_redis.testing import RedisServer

    with RedisServer() as server:
        _consume("redis", server.connector_config(), producer)
        assert server.keys() == []
