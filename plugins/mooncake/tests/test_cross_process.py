"""Producer and consumer in separate processes, through both connectors: a 64 MiB payload, a killed producer, round trips."""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any

import pytest
import torch
from omni_plugins_mooncake.testing import MooncakeMaster
from omni_plugins_mooncake.testing_processes import BIG, Child, digest, echo_store, produce

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

from .conftest import store_config

# processes that list peers explicitly share the control channel's secret (a rendezvous_dir would carry it instead)
TE_SECRET = "cross-process-test-secret-0123456789"
#: seconds a get may wait for a payload that is on its way (a bound on a hang, not a measurement)
ARRIVAL = 60.0


def test_64mib_payload_between_processes(master: MooncakeMaster) -> None:
    key = f"big-{uuid.uuid4().hex}"
    specs = {"mooncake-store": store_config(master), "mooncake-te": {"pool_size": "256MiB", "secret": TE_SECRET}}
    with Child(produce, specs, key, 7) as child:  # holds the payloads until finish()
        addresses, expected = child.answer()
        consumers = {
            # the consumer contributes no segment: the bytes stay in the producer's until read
            "mooncake-store": store_config(master, global_segment_size=0),
            "mooncake-te": {"listen_address": None, "peers": [addresses["mooncake-te"]], "secret": TE_SECRET},
        }
        for name, config in consumers.items():
            with create_connector(name, config) as conn:
                got = conn.get(0, 1, key, timeout=ARRIVAL)
                assert got is not None, name
                assert got.size > BIG and got.data["meta"] == {"seed": 7}
                assert digest(got.data) == expected, f"{name} corrupted the payload"
                del got
                assert conn.get(0, 1, key) is None, f"{name} did not consume"
        health = child.finish()
    assert health["mooncake-te"]["staged"] == 0 and health["mooncake-te"]["staging_pool"]["in_use_bytes"] == 0


def test_te_read_from_a_producer_killed_after_the_claim_fails_fast() -> None:
    """The claim succeeded, then the producer process died: the one-sided read must fail, not wait for the claim to run out."""
    te = {"pool_size": "256MiB", "secret": TE_SECRET}
    with Child(produce, {"mooncake-te": te}, "k", 3) as child:
        addresses, _ = child.answer()
        with create_connector("mooncake-te", {"listen_address": None, "peers": [addresses["mooncake-te"]], "secret": TE_SECRET}) as conn:
            read = conn._read  # type: ignore[attr-defined]

            def kill_then_read(*args: Any) -> int:
                assert child.process.pid is not None
                os.kill(child.process.pid, signal.SIGKILL)
                child.process.join()
                return int(read(*args))

            conn._read = kill_then_read  # type: ignore[attr-defined]
            with pytest.raises(ConnectorError, match="failed"):
                conn.get(0, 1, "k")
            health = conn.health()
            assert health["stranded_receive_buffers"] == 0  # the engine reported the failure: the buffer is reusable
            assert health["receive_buffers"]["in_use_bytes"] == 0
    assert child.process.exitcode == -signal.SIGKILL


def test_store_round_trips_between_two_processes_each_waiting_in_get(master: MooncakeMaster) -> None:
    """Each side consumes and produces on one ``mooncake-store`` instance, and each is already waiting in ``get``
    when the other puts: a read that meets the put of its key under way must wait for it, not fail."""
    prefix, trips = f"rt-{uuid.uuid4().hex}-", 40
    config = store_config(master)
    with create_connector("mooncake-store", config) as store, Child(echo_store, config, prefix, trips) as child:
        assert child.answer() != store.health()["segment"]  # two clients, two segments
        for i in range(trips):
            sent = torch.randint(0, 256, (4096,), dtype=torch.uint8)
            assert store.put(0, 1, f"{prefix}{i}", {"t": sent}).ok
            back = child.wait_for(lambda: store.get(1, 0, f"{prefix}{i}r", timeout=1.0))  # noqa: B023 (called at once)
            assert torch.equal(back.data["t"], sent)
            del back
        health = child.finish()
    assert health["gets"] == trips and health["puts"] == trips and health["remove_failures"] == 0
