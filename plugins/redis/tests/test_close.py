"""``close()`` against a server that stopped answering (SIGSTOP: a hung server or a partition; TCP still accepts).

Calls in flight fail at once instead of waiting out ``socket_timeout`` x
``retry_attempts``, nothing is retried after close, and a put cut short is
withdrawn: once the server resumes, nothing it wrote is left. The joins below
are liveness bounds (far below the socket timeout), not timing assertions.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from omni_plugins_redis.client import Link
from omni_plugins_redis.testing import RedisServer, free_port

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorClosedError

PREFIX = "omnitest:"
CHUNK = 64 * 1024
# long enough that only close() can end a blocked call within the liveness bound
PATIENT = {"socket_timeout": 120.0, "retry_attempts": 6, "chunk_bytes": CHUNK}
BOUND_S = 10.0


@pytest.fixture
def server(track_server: Any) -> Iterator[RedisServer]:
    with RedisServer() as srv:
        track_server(srv)
        try:
            yield srv
        finally:
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGCONT)  # whatever the test did


def _freeze_before(monkeypatch: pytest.MonkeyPatch, server: RedisServer, command: bytes) -> threading.Event:
    """SIGSTOP the server right before the first write carrying ``command``; the returned event is set once it was written."""
    sent = threading.Event()
    real_send = Link.send_frames

    def send_frames(self: Link, frames: Any) -> None:
        hit = not sent.is_set() and b"\r\n" + command + b"\r\n" in b"".join(bytes(f) for f in frames)
        if hit:
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
        real_send(self, frames)
        if hit:
            sent.set()

    monkeypatch.setattr(Link, "send_frames", send_frames)
    return sent


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _resume_and_settle(server: RedisServer) -> None:
    """SIGCONT, then wait until the server has read everything the closed connector sent (its connections are gone)."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGCONT)
    client = server.client()
    try:
        deadline = time.monotonic() + 30
        while len(client.client_list()) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(client.client_list()) == 1, "the closed connector's connections are still open"
    finally:
        client.close()


@pytest.mark.parametrize("size", [100, 300_000], ids=["inline", "parted"])
def test_close_ends_a_put_stuck_on_a_frozen_server_and_withdraws_it(
    monkeypatch: pytest.MonkeyPatch, server: RedisServer, size: int
) -> None:
    conn = create_connector("redis", server.connector_config(key_prefix=PREFIX, **PATIENT))
    committing = _freeze_before(monkeypatch, server, b"EXEC")  # the commit goes to a server that no longer answers
    thread, outcome = _in_thread(lambda: conn.put(0, 1, "stuck", {"v": torch.ones(size)}))
    assert committing.wait(30), "the put never sent its commit"
    conn.close()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the put is still blocked after close()"
    assert len(outcome) == 1 and isinstance(outcome[0], ConnectorClosedError), outcome
    monkeypatch.undo()
    _resume_and_settle(server)  # the server now runs the commit, then the withdrawal queued behind it
    assert server.keys(PREFIX + "*") == [], "a put that failed left keys behind"


def test_close_ends_a_blocked_get_and_gives_a_half_read_payload_back(monkeypatch: pytest.MonkeyPatch, server: RedisServer) -> None:
    config = server.connector_config(key_prefix=PREFIX, **PATIENT)
    payload = {"v": torch.arange(100_000, dtype=torch.float32)}  # 7 parts
    with create_connector("redis", config) as writer:
        assert writer.put(0, 1, "half", payload).ok
    waiter = create_connector("redis", config)
    blocked, blocked_outcome = _in_thread(lambda: waiter.get(0, 1, "never", timeout=60))  # BLMOVE
    reader = create_connector("redis", config)
    reading = _freeze_before(monkeypatch, server, b"GET")  # the part reads go to a server that no longer answers
    thread, outcome = _in_thread(lambda: reader.get(0, 1, "half"))
    assert reading.wait(30), "the get never asked for its parts"
    reader.close()
    waiter.close()
    for t in (thread, blocked):
        t.join(BOUND_S)
        assert not t.is_alive(), "a get is still blocked after close()"
    assert isinstance(outcome[0], ConnectorClosedError) and isinstance(blocked_outcome[0], ConnectorClosedError)
    monkeypatch.undo()
    _resume_and_settle(server)
    with create_connector("redis", config) as again:  # the payload went back to its list: not lost
        got = again.get(0, 1, "half")
        assert got is not None and torch.equal(got.data["v"], payload["v"])
    assert server.keys(PREFIX + "*") == []


def test_close_stops_retries_and_nothing_is_used_after_it() -> None:
    """A put retrying against a server that is down stops at close() (no new pool, no new connection)."""
    config = {"host": "127.0.0.1", "port": free_port(), "retry_attempts": 1000, "retry_backoff": 0.5, "retry_backoff_max": 5.0}
    conn = create_connector("redis", {**config, "key_prefix": PREFIX, "connect_timeout": 1.0})
    thread, outcome = _in_thread(lambda: conn.put(0, 1, "k", {"v": 1}))
    time.sleep(0.3)  # into its retries (not needed for correctness: a put that had not started fails the same way)
    conn.close()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the put kept retrying after close()"
    assert isinstance(outcome[0], ConnectorClosedError), outcome
    client = conn._client  # type: ignore[attr-defined]
    (route,) = client.topology.primaries()
    made = len(route.pool._connections)
    with pytest.raises(ConnectorClosedError):
        client.run(0, lambda link: link.call("PING"), what="ping", key="k")
    assert len(route.pool._connections) == made, "a closed client made a new connection"


def test_a_call_that_checks_out_its_connection_while_close_runs_fails_instead_of_blocking(server: RedisServer) -> None:
    """close() between a call's own look at it and the call's first command: the call must not go on to block."""
    conn = create_connector("redis", server.connector_config(key_prefix=PREFIX, **PATIENT))
    client = conn._client  # type: ignore[attr-defined]
    route = client.topology.route(0)
    while route.kept:  # the next call checks a connection out of the pool
        route.pool.release(route.kept.pop())
    real_get_connection = route.pool.get_connection

    def get_connection(*args: Any, **kwargs: Any) -> Any:
        closing = threading.Thread(target=conn.close)
        closing.start()  # close() runs to its end while this call holds no link yet
        closing.join(BOUND_S)
        return real_get_connection(*args, **kwargs)

    route.pool.get_connection = get_connection
    thread, outcome = _in_thread(lambda: conn.get(0, 1, "never", timeout=60))  # would block in BLMOVE for its slice
    thread.join(BOUND_S)
    assert not thread.is_alive(), "a get went on to block after close()"
    assert isinstance(outcome[0], ConnectorClosedError)
