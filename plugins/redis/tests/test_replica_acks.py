"""``min_replica_acks``: a put returns ok only once replicas confirmed it (WAIT); one that falls short fails and is withdrawn.

A real primary with one real replica; "the replica falls behind" is a SIGSTOPped
replica process (it stays connected and stops acknowledging). A reader blocked
on the key meanwhile must not receive the unconfirmed payload, and nothing of
the failed put may stay on the server.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from omni_plugins_redis.connector import ReplicaAckError
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.testing import RedisServer

from omni_plugins import create_connector

PREFIX = "omniacks:"
# A healthy replica confirms within milliseconds, but a loaded machine can delay it by more than a second: a put
# that must succeed waits long. A stopped replica never confirms, so a shortfall needs no long wait.
CONFIRMED = {"min_replica_acks": 1, "replica_ack_timeout": 10.0, "key_prefix": PREFIX, "chunk_bytes": 64 * 1024}
SHORT = {**CONFIRMED, "replica_ack_timeout": 0.3}


@pytest.fixture(scope="module")
def primary_and_replica(track_server: Any) -> Iterator[tuple[RedisServer, RedisServer]]:
    with RedisServer() as primary:
        track_server(primary)
        with RedisServer(replica_of=primary) as replica:
            track_server(replica)
            client = primary.client()
            try:  # the replica is in sync before any test
                for _ in range(500):
                    if client.execute_command("WAIT", 1, 100) == 1:
                        break
            finally:
                client.close()
            yield primary, replica
            assert primary.keys(PREFIX + "*") == []


class _Stopped:
    """SIGSTOP a server process for the block (connections stay up, nothing is acknowledged)."""

    def __init__(self, server: RedisServer) -> None:
        assert server.pid is not None
        self.pid = server.pid

    def __enter__(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


@pytest.mark.parametrize("size", [1_000, 300_000], ids=["inline", "parted"])
def test_a_confirmed_put_is_on_the_replica_when_put_returns(primary_and_replica: tuple[RedisServer, RedisServer], size: int) -> None:
    primary, replica = primary_and_replica
    with create_connector("redis", primary.connector_config(**CONFIRMED)) as conn:
        assert conn.put(0, 1, "confirmed", {"v": torch.ones(size // 4)}).ok
        manifest = PayloadKeys(PREFIX, "confirmed").manifest
        on_replica = replica.client()
        try:
            assert on_replica.llen(manifest) == 1, "put returned ok before the replica had the payload"
        finally:
            on_replica.close()
        got = conn.get(0, 1, "confirmed", timeout=5)
        assert got is not None and torch.equal(got.data["v"], torch.ones(size // 4))


@pytest.mark.parametrize("size", [1_000, 300_000], ids=["inline", "parted"])
def test_a_put_the_replicas_do_not_confirm_fails_and_is_never_delivered(
    primary_and_replica: tuple[RedisServer, RedisServer], size: int
) -> None:
    primary, replica = primary_and_replica
    config = primary.connector_config(**SHORT)
    delivered: list[Any] = []
    with create_connector("redis", config) as writer, create_connector("redis", config) as reader:
        waiting = threading.Thread(target=lambda: delivered.append(reader.get(0, 1, "unconfirmed", timeout=1.5)))
        with _Stopped(replica):
            waiting.start()  # blocked on the key before the put: it sees the commit at once
            with pytest.raises(ReplicaAckError, match=r"'unconfirmed'.*0 of 1 replica"):
                writer.put(0, 1, "unconfirmed", {"v": torch.ones(size // 4)})
            waiting.join(30)
        assert not waiting.is_alive()
        assert delivered == [None], "a reader received a payload whose put failed"
        assert reader.get(0, 1, "unconfirmed") is None
    assert primary.keys(PREFIX + "*") == [], "the failed put left keys behind"


@pytest.mark.parametrize("size", [1_000, 300_000], ids=["inline", "parted"])
def test_put_many_is_confirmed_for_every_key_or_withdrawn_from_every_key(
    primary_and_replica: tuple[RedisServer, RedisServer], size: int
) -> None:
    """One WAIT after a fan-out's commits: confirmed, every key is on the replica; short of it, every key is withdrawn."""
    primary, replica = primary_and_replica
    keys = [f"many-{i}" for i in range(3)]
    targets = [(0, i + 1, k) for i, k in enumerate(keys)]
    payload = {"v": torch.ones(size // 4)}
    with create_connector("redis", primary.connector_config(**CONFIRMED)) as conn:
        assert all(r.ok for r in conn.put_many(targets, payload))
        on_replica = replica.client()
        try:
            assert [on_replica.llen(PayloadKeys(PREFIX, k).manifest) for k in keys] == [1, 1, 1]
        finally:
            on_replica.close()
        for i, key in enumerate(keys):
            got = conn.get(0, i + 1, key, timeout=5)
            assert got is not None and torch.equal(got.data["v"], payload["v"])
    with create_connector("redis", primary.connector_config(**SHORT)) as conn:
        with _Stopped(replica):
            results = conn.put_many(targets, payload)
        assert [r.ok for r in results] == [False] * 3
        assert all("0 of 1 replica" in r.metadata["error"] for r in results)
        assert all(conn.get(0, 1, k) is None for k in keys)
    assert primary.keys(PREFIX + "*") == [], "the failed puts left keys behind"


def test_acknowledged_puts_after_the_replica_returns(primary_and_replica: tuple[RedisServer, RedisServer]) -> None:
    """A shortfall is not sticky: once the replica acknowledges again, puts succeed and every one is delivered.

    One connector for both (what could stick is its own state), so the shortfall waits the long timeout.
    """
    primary, replica = primary_and_replica
    with create_connector("redis", primary.connector_config(**CONFIRMED)) as conn:
        with _Stopped(replica), pytest.raises(ReplicaAckError):
            conn.put(0, 1, "again", {"v": 1})
        for i in range(5):
            assert conn.put(0, 1, f"again-{i}", {"v": i}).ok
        for i in range(5):
            got = conn.get(0, 1, f"again-{i}", timeout=5)
            assert got is not None and got.data == {"v": i}
        assert conn.get(0, 1, "again") is None
    assert primary.keys(PREFIX + "*") == []
