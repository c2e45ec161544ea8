"""A producer process and a consumer process move a 64 MiB payload intact, through both connectors."""

from __future__ import annotations

import uuid

from omni_plugins_mooncake.testing import MooncakeMaster

from omni_plugins import create_connector
from omni_plugins.testing.processes import process_context

from . import _children
from .conftest import store_config

# processes that list peers explicitly share the control channel's secret (a rendezvous_dir would carry it instead)
TE_SECRET = "cross-process-test-secret-0123456789"


def test_64mib_payload_between_processes(master: MooncakeMaster) -> None:
    ctx = process_context()
    ready, report, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    key = f"big-{uuid.uuid4().hex}"
    specs = {"mooncake-store": store_config(master), "mooncake-te": {"pool_size": "256MiB", "secret": TE_SECRET}}
    child = ctx.Process(target=_children.produce, args=(specs, key, 7, ready, done, report))
    child.start()
    try:
        addresses, expected = ready.get(timeout=180)
        consumers = {
            # the consumer contributes no segment: the bytes stay in the producer's until read
            "mooncake-store": store_config(master, global_segment_size=0),
            "mooncake-te": {"listen_address": None, "peers": [addresses["mooncake-te"]], "secret": TE_SECRET},
        }
        for name, config in consumers.items():
            with create_connector(name, config) as conn:
                got = conn.get(0, 1, key, timeout=30)
                assert got is not None, name
                assert got.size > _children.BIG and got.data["meta"] == {"seed": 7}
                assert _children.digest(got.data) == expected, f"{name} corrupted the payload"
                del got
                assert conn.get(0, 1, key) is None, f"{name} did not consume"
        done.set()
        health = report.get(timeout=60)
        assert health["mooncake-te"]["staged"] == 0 and health["mooncake-te"]["staging_pool"]["in_use_bytes"] == 0
    finally:
        done.set()
        child.join(60)
    assert child.exitcode == 0


def test_te_read_from_a_producer_killed_after_the_claim_fails_fast() -> None:
    """The claim succeeded, then the producer process died: the one-sided read must fail, not wait for the claim to run out."""
    import os
    import signal
    from typing import Any

    import pytest

    from omni_plugins.errors import ConnectorError

    ctx = process_context()
    ready, report, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    te = {"pool_size": "256MiB", "secret": TE_SECRET}
    child = ctx.Process(target=_children.produce, args=({"mooncake-te": te}, "k", 3, ready, done, report))
    child.start()
    try:
        addresses, _ = ready.get(timeout=180)
        with create_connector("mooncake-te", {"listen_address": None, "peers": [addresses["mooncake-te"]], "secret": TE_SECRET}) as conn:
            read = conn._read  # type: ignore[attr-defined]

            def kill_then_read(*args: Any) -> int:
                assert child.pid is not None
                os.kill(child.pid, signal.SIGKILL)
                child.join(30)
                return int(read(*args))

            conn._read = kill_then_read  # type: ignore[attr-defined]
            with pytest.raises(ConnectorError, match="failed"):
                conn.get(0, 1, "k")
            health = conn.health()
            assert health["stranded_receive_buffers"] == 0  # the engine reported the failure: the buffer is reusable
            assert health["receive_buffers"]["in_use_bytes"] == 0
    finally:
        if child.is_alive():  # never set() with a killed waiter: a multiprocessing Event would wait for it forever
            done.set()
        child.join(60)
    assert child.exitcode == -signal.SIGKILL
