"""Server restarts and lost replies: nothing acknowledged is lost, nothing is duplicated, nothing hangs.

The restart tests use a real persistent server (AOF, ``appendfsync always``).
Lost replies are injected at unit level: the command really runs on the real
server, then the client pretends the connection died before the reply came.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from omni_plugins_redis.client import Link, RedisClient
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.testing import RedisServer

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

PREFIX = "omnitest:"
CHUNK = 64 * 1024
FAST_RETRY = {"retry_attempts": 30, "retry_backoff": 0.02, "retry_backoff_max": 0.5, "socket_timeout": 5.0, "connect_timeout": 2.0}


@pytest.fixture
def durable_server(track_server: Any) -> Iterator[RedisServer]:
    with RedisServer(persistent=True) as server:
        track_server(server)
        yield server
        assert server.keys(PREFIX + "*") == [], "keys left behind after restarts"


def _lose_reply(monkeypatch: pytest.MonkeyPatch, command: str) -> list[int]:
    """The first time ``command`` is sent, read the replies of its batch for real, then fail as if the link died."""
    real_send, real_read, real_pair, real_settle, real_expect = (
        Link.send_frames,
        Link.read,
        Link.read_pair,
        Link._settle_deferred,
        Link.expect,
    )
    state: dict[str, Any] = {"left": 0, "link": None, "settling": 0}
    fired: list[int] = []

    def send_frames(self: Link, frames: Any) -> None:
        names = _command_names(b"".join(bytes(f) for f in frames))
        if not fired and not state["left"] and command.encode() in names:
            state["left"], state["link"] = len(names), self
        real_send(self, frames)

    def counted(real: Any, replies: int) -> Any:
        def wrapper(self: Link, *args: Any, **kwargs: Any) -> Any:
            reply = real(self, *args, **kwargs)
            if state["left"] and state["link"] is self and not state["settling"]:  # deferred cleanup's replies don't count
                state["left"] = max(0, state["left"] - replies)
                if not state["left"]:
                    fired.append(1)
                    raise ConnectionResetError(f"injected: reply to {command} lost")
            return reply

        return wrapper

    def settle(self: Link, *args: Any) -> None:
        state["settling"] += 1
        try:
            real_settle(self, *args)
        finally:
            state["settling"] -= 1

    def expect(self: Link, pattern: Any) -> Any:  # the fast path consumes the whole batch at once
        found = real_expect(self, pattern)
        if found is not None and state["left"] and state["link"] is self:
            state["left"] = 0
            fired.append(1)
            raise ConnectionResetError(f"injected: reply to {command} lost")
        return found

    monkeypatch.setattr(Link, "send_frames", send_frames)
    monkeypatch.setattr(Link, "read", counted(real_read, 1))
    monkeypatch.setattr(Link, "read_pair", counted(real_pair, 2))
    monkeypatch.setattr(Link, "_settle_deferred", settle)
    monkeypatch.setattr(Link, "expect", expect)
    return fired


def _command_names(frame: bytes) -> list[bytes]:
    """The command names in a RESP-framed pipeline (``*n`` then ``n`` bulk strings per command)."""
    names, pos = [], 0
    while pos < len(frame):
        end = frame.index(b"\r\n", pos)
        count, pos = int(frame[pos + 1 : end]), end + 2
        for i in range(count):
            end = frame.index(b"\r\n", pos)
            size, pos = int(frame[pos + 1 : end]), end + 2
            if i == 0:
                names.append(frame[pos : pos + size].upper())
            pos += size + 2
    return names


@pytest.mark.parametrize("size", [100, 300_000])
def test_lost_commit_reply_commits_exactly_once(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, server_config: dict[str, Any], size: int
) -> None:
    fired = _lose_reply(monkeypatch, "EXEC")
    with create_connector("redis", {**server_config, "chunk_bytes": CHUNK, **FAST_RETRY}) as conn:
        assert conn.put(0, 1, "once", {"v": torch.ones(size)}).ok
        assert fired, "the fault was not injected"
        assert redis_server.client().llen(PayloadKeys(PREFIX, "once").manifest) == 1
        got = conn.get(0, 1, "once")
        assert got is not None and torch.equal(got.data["v"], torch.ones(size))
        assert conn.get(0, 1, "once") is None
    assert redis_server.keys(PREFIX + "*") == []


@pytest.mark.parametrize("size", [100, 300_000])
def test_lost_reply_of_a_put_many_commits_every_key_exactly_once(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, server_config: dict[str, Any], size: int
) -> None:
    """The write of a fan-out's commits ran, its replies were lost after the first: each key settles alone, committed once."""
    fired = _lose_reply(monkeypatch, "EXEC")
    keys = [f"many-{i}" for i in range(3)]
    with create_connector("redis", {**server_config, "chunk_bytes": CHUNK, **FAST_RETRY}) as conn:
        results = conn.put_many([(0, i + 1, k) for i, k in enumerate(keys)], {"v": torch.ones(size)})
        assert fired, "the fault was not injected"
        assert all(r.ok for r in results)
        client = redis_server.client()
        assert [client.llen(PayloadKeys(PREFIX, k).manifest) for k in keys] == [1, 1, 1]
        for i, key in enumerate(keys):
            got = conn.get(0, i + 1, key)
            assert got is not None and torch.equal(got.data["v"], torch.ones(size))
            assert conn.get(0, i + 1, key) is None
    assert redis_server.keys(PREFIX + "*") == []


@pytest.mark.parametrize("blocking", [False, True])
def test_lost_claim_reply_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, server_config: dict[str, Any], blocking: bool
) -> None:
    with create_connector("redis", {**server_config, **FAST_RETRY}) as conn:
        assert conn.put(0, 1, "claimed", {"v": torch.arange(7)}).ok
        fired = _lose_reply(monkeypatch, "BLMOVE" if blocking else "LMOVE")
        got = conn.get(0, 1, "claimed", timeout=5 if blocking else None)
        assert fired, "the fault was not injected"
        assert got is not None and torch.equal(got.data["v"], torch.arange(7))
        assert conn.get(0, 1, "claimed") is None
    assert redis_server.keys(PREFIX + "*") == []


def test_restarts_mid_stream_lose_no_acknowledged_payload(durable_server: RedisServer) -> None:
    config = durable_server.connector_config(key_prefix=PREFIX, chunk_bytes=CHUNK, **FAST_RETRY)
    count = 60
    sizes = [10, 5_000, 70_000, 200_000]  # inline and 1..13 parts
    acked: dict[int, bool] = {}
    put_errors: list[str] = []
    received: dict[int, Any] = {}
    get_errors: list[str] = []
    progress = threading.Semaphore(0)

    def expected(i: int) -> torch.Tensor:
        return torch.full((sizes[i % len(sizes)],), float(i))

    def write() -> None:
        with create_connector("redis", config) as conn:
            for i in range(count):
                try:
                    acked[i] = conn.put(0, 1, f"s{i}", {"i": i, "v": expected(i)}).ok
                except ConnectorError as exc:
                    put_errors.append(str(exc))
                progress.release()
                time.sleep(0.01)

    def read() -> None:
        with create_connector("redis", config) as conn:
            for i in range(count):
                try:
                    got = conn.get(0, 1, f"s{i}", timeout=30)
                except ConnectorError as exc:
                    get_errors.append(str(exc))
                    continue
                if got is not None:
                    received[i] = got.data

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for restart_at, kill in ((count // 3, False), (2 * count // 3, True)):
        for _ in range(restart_at - (0 if not kill else count // 3)):
            assert progress.acquire(timeout=60)
        durable_server.restart(kill=kill)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a thread hung across the restarts"
    assert put_errors == [] and get_errors == []
    lost = [i for i, ok in acked.items() if ok and i not in received]
    assert lost == [], f"acknowledged payloads lost: {lost}"
    for i, data in received.items():
        assert data["i"] == i and torch.equal(data["v"], expected(i))


def test_blocked_get_survives_a_restart(durable_server: RedisServer) -> None:
    config = durable_server.connector_config(key_prefix=PREFIX, **FAST_RETRY)
    result: list[Any] = []
    with create_connector("redis", config) as reader, create_connector("redis", config) as writer:
        thread = threading.Thread(target=lambda: result.append(reader.get(0, 1, "late", timeout=20)))
        thread.start()
        time.sleep(0.3)  # the reader is now blocked inside the server
        durable_server.restart()
        assert writer.put(0, 1, "late", {"v": torch.arange(4)}).ok
        thread.join(60)
    assert not thread.is_alive()
    assert result and result[0] is not None and torch.equal(result[0].data["v"], torch.arange(4))


def test_server_down_fails_in_bounded_time(durable_server: RedisServer) -> None:
    config = durable_server.connector_config(
        key_prefix=PREFIX, retry_attempts=3, retry_backoff=0.05, connect_timeout=1.0, socket_timeout=2.0
    )
    errors: list[BaseException] = []
    with create_connector("redis", config) as conn:
        durable_server._terminate()  # down, data dir kept

        def call(fn: Any) -> None:
            try:
                fn()
            except ConnectorError as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=call, args=(lambda: conn.get(0, 1, "x", timeout=1.0),)),
            threading.Thread(target=call, args=(lambda: conn.put(0, 1, "x", {"v": 1}),)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a call hung on a dead server"
        assert len(errors) == 2
        for exc in errors:
            assert f"127.0.0.1:{durable_server.port}" in str(exc) and "'x'" in str(exc)
        durable_server.start()
        assert conn.put(0, 1, "back", {"v": 1}).ok  # reconnects after the outage
        got = conn.get(0, 1, "back")
        assert got is not None and got.data == {"v": 1}


def test_failed_put_leaves_nothing_visible(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, server_config: dict[str, Any]
) -> None:
    fired = _lose_reply(monkeypatch, "EXEC")  # the commit ran, but the writer never learns it
    with create_connector("redis", {**server_config, "chunk_bytes": CHUNK, "retry_attempts": 0}) as conn:
        with pytest.raises(ConnectorError, match="'withdrawn'"):
            conn.put(0, 1, "withdrawn", {"v": torch.ones(50_000)})
        assert fired
        assert conn.get(0, 1, "withdrawn") is None
    assert redis_server.keys(PREFIX + "*") == []


def test_deferred_replies_never_mix_with_later_replies(redis_server: RedisServer, server_config: dict[str, Any]) -> None:
    raw = redis_server.client()
    raw.set(PREFIX + "str", "x")
    client = RedisClient(RedisConfig(**server_config))
    try:
        client.run(0, lambda link: link.defer(0, "LPUSH", PREFIX + "str", "y"), what="t", key="k")  # WRONGTYPE: logged, not raised
        client.run(0, lambda link: link.defer(0, "DEL", PREFIX + "str"), what="t", key="k")
        assert client.run(0, lambda link: link.call("ECHO", "first"), what="t", key="k") == b"first"
        client.run(0, lambda link: link.defer(0, "DEL", PREFIX + "nothing"), what="t", key="k")
        assert client.run(0, lambda link: link.call("ECHO", "second"), what="t", key="k") == b"second"
        assert not any(route.queue.pending for route in client.topology.routes())
    finally:
        client.close()
    assert raw.exists(PREFIX + "str") == 0


def test_retired_parts_are_handed_back_if_the_connection_dies(redis_server: RedisServer, server_config: dict[str, Any]) -> None:
    """Cleanup sent on a link that then fails is not lost: it goes again with the next write to that server."""
    raw = redis_server.client()
    parts = [f"{PREFIX}{{a}}:p:1:{i}".encode() for i in range(2)]
    for part in parts:
        raw.set(part, b"x")
    client = RedisClient(RedisConfig(**server_config))

    def dies_after_sending(link: Link) -> None:
        link.send([("PING",)])  # the retired parts' UNLINK goes out first
        raise ConnectionResetError("injected: the connection died before any reply")

    try:
        client.run(0, lambda link: link.retire(0, parts), what="t", key="k")
        with pytest.raises(ConnectorError):
            client.run(0, dies_after_sending, what="t", key="k", retries=0)
        (route,) = client.topology.routes()
        assert route.queue.pending, "the unconfirmed delete was dropped"
        assert client.run(0, lambda link: link.call("PING"), what="t", key="k") in (b"PONG", "PONG", True)
        assert raw.exists(*parts) == 0
    finally:
        client.close()


def _no_withdrawal(monkeypatch: pytest.MonkeyPatch, conn: Any) -> None:
    """The server is unreachable for the withdrawal of a failed put (a partition): it does not run."""
    monkeypatch.setattr(conn, "_abandon", lambda state: False)


def test_a_retried_put_whose_outcome_was_unknown_is_committed_once(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, server_config: dict[str, Any]
) -> None:
    """The commit ran, its reply was lost and the withdrawal could not run: the caller's retry of that payload
    continues the same put (its commit marker shows it went in) instead of committing a second copy."""
    data = {"v": torch.arange(1000)}
    with create_connector("redis", {**server_config, "retry_attempts": 0}) as conn:
        fired = _lose_reply(monkeypatch, "EXEC")
        with monkeypatch.context() as m:
            _no_withdrawal(m, conn)
            with pytest.raises(ConnectorError):
                conn.put(0, 1, "unsure", data)
        assert fired
        assert conn.put(0, 1, "unsure", data).ok  # the runtime's send thread retries with the same payload
        assert redis_server.client().llen(PayloadKeys(PREFIX, "unsure").manifest) == 1
        got = conn.get(0, 1, "unsure")
        assert got is not None and torch.equal(got.data["v"], data["v"])
        assert conn.get(0, 1, "unsure") is None
    assert redis_server.keys(PREFIX + "*") == []


def test_another_put_of_the_key_or_close_withdraws_an_unsettled_put(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer, server_config: dict[str, Any]
) -> None:
    for then in ("other payload", "close"):
        with create_connector("redis", {**server_config, "retry_attempts": 0}) as conn:
            _lose_reply(monkeypatch, "EXEC")
            with monkeypatch.context() as m:
                _no_withdrawal(m, conn)
                with pytest.raises(ConnectorError):
                    conn.put(0, 1, "stale", {"v": 1})
            monkeypatch.undo()
            if then == "other payload":
                assert conn.put(0, 1, "stale", {"v": 2}).ok
                got = conn.get(0, 1, "stale")
                assert got is not None and got.data == {"v": 2}  # the unsettled commit was withdrawn first
                assert conn.get(0, 1, "stale") is None
        assert redis_server.keys(PREFIX + "*") == [], then
