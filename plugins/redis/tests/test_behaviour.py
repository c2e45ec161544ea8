"""Chunked payloads, atomic visibility, exactly-once consumption, TTL, untrusted bytes."""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import pytest
import redis
import torch
from omni_plugins_redis import manifest as mf
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.testing import RedisCluster, RedisServer

from omni_plugins import create_connector, wire
from omni_plugins.errors import ConnectorError, CorruptPayloadError, WireFormatError

PREFIX = "omnitest:"
SMALL_CHUNK = 64 * 1024


def _raw(server: RedisServer) -> redis.Redis:
    return server.client()


def test_multi_part_payload_roundtrip_into_one_writable_buffer(server_config: dict[str, Any], redis_server: RedisServer) -> None:
    x = torch.randn(1_000_003)  # ~4 MB, not a multiple of the chunk size
    y = torch.arange(77, dtype=torch.int16)
    with create_connector("redis", {**server_config, "chunk_bytes": SMALL_CHUNK}) as conn:
        res = conn.put(0, 1, "parts", {"x": x, "y": y, "s": "meta"})
        assert res.ok and res.metadata is not None and res.metadata["parts"] > 50
        # parts exist before the get; the manifest is one list element
        raw = _raw(redis_server)
        assert raw.llen(PayloadKeys(PREFIX, "parts").manifest) == 1
        got = conn.get(0, 1, "parts")
    assert got is not None and got.size == res.size
    assert torch.equal(got.data["x"], x) and torch.equal(got.data["y"], y) and got.data["s"] == "meta"
    got.data["x"][0] = 42.0  # tensors own writable memory
    assert redis_server.keys(PREFIX + "*") == []


def test_reader_never_sees_half_a_payload(server_config: dict[str, Any]) -> None:
    big = torch.arange(4_000_000, dtype=torch.float32)  # 16 MB in 256 parts
    config = {**server_config, "chunk_bytes": SMALL_CHUNK}
    seen: list[Any] = []
    with create_connector("redis", config) as writer, create_connector("redis", config) as reader:

        def poll() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = reader.get(0, 1, "half")  # non-blocking: races the writer's parts
                if got is not None:
                    seen.append(got.data)
                    return

        thread = threading.Thread(target=poll)
        thread.start()
        assert writer.put(0, 1, "half", {"v": big}).ok
        thread.join(90)
    assert not thread.is_alive()
    assert len(seen) == 1 and torch.equal(seen[0]["v"], big)


@pytest.mark.parametrize("target", ["standalone", "cluster"])
def test_exactly_one_of_many_blocked_readers_wins(target: str, request: pytest.FixtureRequest) -> None:
    config = request.getfixturevalue("server_config" if target == "standalone" else "cluster_config")
    results: list[Any] = []
    lock = threading.Lock()
    with create_connector("redis", config) as conn:

        def wait() -> None:
            got = conn.get(0, 1, "contested", timeout=3)
            with lock:
                results.append(got)

        threads = [threading.Thread(target=wait) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert conn.put(0, 1, "contested", {"v": torch.arange(9)}).ok
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    winners = [r for r in results if r is not None]
    assert len(results) == 4 and len(winners) == 1
    assert torch.equal(winners[0].data["v"], torch.arange(9))


def test_two_puts_of_one_key_are_read_in_order(server_config: dict[str, Any]) -> None:
    with create_connector("redis", {**server_config, "chunk_bytes": SMALL_CHUNK}) as conn:
        assert conn.put(0, 1, "twice", {"v": 1}).ok
        assert conn.put(0, 1, "twice", {"v": torch.zeros(100_000)}).ok
        first, second = conn.get(0, 1, "twice"), conn.get(0, 1, "twice")
        assert first is not None and first.data == {"v": 1}
        assert second is not None and torch.equal(second.data["v"], torch.zeros(100_000))
        assert conn.get(0, 1, "twice") is None


def test_unread_payloads_expire(redis_server: RedisServer, server_config: dict[str, Any]) -> None:
    with create_connector("redis", {**server_config, "ttl_seconds": 0.5, "chunk_bytes": SMALL_CHUNK}) as conn:
        assert conn.put(0, 1, "orphan", {"v": torch.zeros(50_000)}).ok
        keys = redis_server.keys(PREFIX + "*orphan*")
        assert any(k.endswith(b":m") for k in keys) and any(b":p:" in k for k in keys)
        ttls = [_raw(redis_server).pttl(k) for k in keys]
        assert all(t > 0 for t in ttls), "every key of a payload carries a TTL"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _raw(redis_server).exists(PayloadKeys(PREFIX, "orphan").manifest):
            time.sleep(0.05)
        assert conn.get(0, 1, "orphan") is None
    _raw(redis_server).delete(*redis_server.keys(PREFIX + "*orphan*") or [b"-"])


def test_cleanup_removes_every_part_on_cluster(redis_cluster: RedisCluster, cluster_config: dict[str, Any]) -> None:
    with create_connector("redis", {**cluster_config, "chunk_bytes": SMALL_CHUNK}) as conn:
        for key in ("a{b}c", "ünï/cøde", "%7B"):
            assert conn.put(0, 1, key, {"v": torch.ones(100_000)}).ok
        assert len(redis_cluster.keys(PREFIX + "*")) > 3 * 6
        assert conn.cleanup("a{b}c") is True
        got = conn.get(0, 1, "ünï/cøde", timeout=1)
        assert got is not None and torch.equal(got.data["v"], torch.ones(100_000))
        assert conn.cleanup("%7B") is True
        assert conn.cleanup("%7B") is False
    assert redis_cluster.keys(PREFIX + "*") == []


def test_corrupt_manifest_is_a_clear_error_and_nothing_leaks(redis_server: RedisServer, server_config: dict[str, Any]) -> None:
    raw = _raw(redis_server)
    keys = PayloadKeys(PREFIX, "evil")
    with create_connector("redis", server_config) as conn:
        raw.rpush(keys.manifest, b"not a manifest")
        # damaged framing: typed (a WireFormatError: the runtime fails the request at once), already discarded
        with pytest.raises(CorruptPayloadError, match=r"'evil'.*corrupt manifest"):
            conn.get(0, 1, "evil")
        assert redis_server.keys(PREFIX + "*") == []
        raw.rpush(keys.manifest, struct.pack("<4sB3xQII16s", b"XXXX", 0, 0, 0, 0, b"0" * 16))
        with pytest.raises(CorruptPayloadError, match="bad manifest magic"):
            conn.get(0, 1, "evil")
        # a manifest announcing an absurd size is refused before any allocation
        raw.rpush(keys.manifest, struct.pack("<4sB3xQII16s", b"ORM1", 0, 1 << 60, 1 << 20, 1 << 31, b"0" * 16))
        with pytest.raises(CorruptPayloadError, match="max_payload_bytes"):
            conn.get(0, 1, "evil")
        # a well-formed manifest around bytes that are not a wire message
        raw.rpush(keys.manifest, mf.for_inline(5, "0" * 16).header() + b"junk!")
        with pytest.raises(WireFormatError):
            conn.get(0, 1, "evil")
    assert redis_server.keys(PREFIX + "*") == []


def _crafted(total: int, chunk: int, nparts: int, put_id: str = "0123456789abcdef") -> bytes:
    return struct.pack("<4sB3xQII16s", b"ORM1", 0, total, chunk, nparts, put_id.encode())


@pytest.fixture
def no_big_lists(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fail if anything builds the list of a payload's part names for many parts, or allocates a payload buffer.

    Returns the sizes ``empty_bytes`` was asked for.
    """
    from omni_plugins_redis import connector

    real_parts, real_empty = PayloadKeys.parts, connector.empty_bytes
    allocated: list[int] = []

    def parts(self: PayloadKeys, put_id: str, count: int) -> list[bytes]:
        assert count <= 1000, f"a list of {count} part names was built"
        return real_parts(self, put_id, count)

    def empty_bytes(nbytes: int) -> Any:
        allocated.append(nbytes)
        return real_empty(nbytes)

    monkeypatch.setattr(PayloadKeys, "parts", parts)
    monkeypatch.setattr(connector, "empty_bytes", empty_bytes)
    return allocated


def test_manifest_bomb_is_refused_before_anything_is_sized_by_it(
    redis_server: RedisServer, server_config: dict[str, Any], no_big_lists: list[int]
) -> None:
    """Crafted manifests that would make a reader build huge lists or allocate a huge buffer: typed error, nothing left."""
    raw = _raw(redis_server)
    keys = PayloadKeys(PREFIX, "bomb")
    put_id = "00000000000000aa"
    with create_connector("redis", {**server_config, "max_payload_bytes": 4 << 30}) as conn:
        # 40 bytes naming 2**32-1 parts of one byte each
        raw.rpush(keys.manifest, _crafted(2**32 - 1, 1, 2**32 - 1))
        with pytest.raises(CorruptPayloadError, match=r"'bomb'.*chunk=1 outside"):
            conn.get(0, 1, "bomb")
        assert redis_server.keys(PREFIX + "*") == []
        # the most parts a manifest may name under this cap (65536), none stored but the last one
        raw.rpush(keys.manifest, _crafted(4 << 30, SMALL_CHUNK, 65536, put_id))
        raw.set(keys.part(put_id, 65535), b"x" * SMALL_CHUNK, px=60_000)
        with pytest.raises(CorruptPayloadError, match=r"'bomb'.*part 0 is missing"):
            conn.get(0, 1, "bomb")
        assert redis_server.keys(PREFIX + "*") == [], "claim list or a part left behind"
        # cleanup() of such a manifest deletes its parts batch by batch as well
        raw.rpush(keys.manifest, _crafted(4 << 30, SMALL_CHUNK, 65536, put_id))
        raw.set(keys.part(put_id, 65535), b"x", px=60_000)
        assert conn.cleanup("bomb") is True
        assert redis_server.keys(PREFIX + "*") == []
    assert no_big_lists == []


def test_huge_total_is_not_allocated_before_part_0_checks_out(
    redis_server: RedisServer, server_config: dict[str, Any], no_big_lists: list[int]
) -> None:
    raw = _raw(redis_server)
    keys = PayloadKeys(PREFIX, "huge")
    put_id = "00000000000000bb"
    total, chunk = 60 << 30, 256 << 20  # within the default max_payload_bytes (64 GiB)
    with create_connector("redis", server_config) as conn:
        raw.rpush(keys.manifest, _crafted(total, chunk, -(-total // chunk), put_id))
        with pytest.raises(CorruptPayloadError, match=r"'huge'.*part 0 is missing"):
            conn.get(0, 1, "huge")
        raw.rpush(keys.manifest, _crafted(total, chunk, -(-total // chunk), put_id))
        raw.set(keys.part(put_id, 0), b"x" * 10, px=60_000)  # not the announced size
        with pytest.raises(CorruptPayloadError, match=r"'huge'.*part 0 is corrupt: stored part is 10 bytes"):
            conn.get(0, 1, "huge")
        assert conn.get(0, 1, "huge") is None  # discarded: a retry finds nothing
    assert no_big_lists == []
    assert redis_server.keys(PREFIX + "*") == []


def test_payload_buffer_that_cannot_be_allocated(
    redis_server: RedisServer, server_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MemoryError for the payload buffer (after part 0 checked out): the payload is discarded, the connector goes on."""
    from omni_plugins_redis import connector

    def no_memory(nbytes: int) -> Any:
        raise MemoryError(f"cannot allocate {nbytes}")

    with create_connector("redis", {**server_config, "chunk_bytes": SMALL_CHUNK}) as conn:
        assert conn.put(0, 1, "oom", {"v": torch.ones(100_000)}).ok
        with monkeypatch.context() as patch:
            patch.setattr(connector, "empty_bytes", no_memory)
            with pytest.raises(CorruptPayloadError, match=r"'oom'.*cannot be allocated"):
                conn.get(0, 1, "oom")
        assert redis_server.keys(PREFIX + "*") == []
        assert conn.put(0, 1, "after", {"v": torch.ones(100_000)}).ok
        got = conn.get(0, 1, "after")
        assert got is not None and torch.equal(got.data["v"], torch.ones(100_000))
    assert redis_server.keys(PREFIX + "*") == []


def test_missing_or_wrong_size_part(redis_server: RedisServer, server_config: dict[str, Any]) -> None:
    raw = _raw(redis_server)
    with create_connector("redis", {**server_config, "chunk_bytes": SMALL_CHUNK}) as conn:
        assert conn.put(0, 1, "holey", {"v": torch.ones(100_000)}).ok
        raw.delete(next(k for k in redis_server.keys(PREFIX + "*holey*") if b":p:" in k and k.endswith(b":2")))
        with pytest.raises(CorruptPayloadError, match=r"'holey'.*part 2 is missing"):
            conn.get(0, 1, "holey")
        assert conn.get(0, 1, "holey") is None  # discarded, not given back
        assert conn.put(0, 1, "short", {"v": torch.ones(100_000)}).ok
        part = next(k for k in redis_server.keys(PREFIX + "*short*") if k.endswith(b":1") and b":p:" in k)
        raw.set(part, b"x" * 10)
        with pytest.raises(CorruptPayloadError, match="part 1 is corrupt"):
            conn.get(0, 1, "short")
    assert redis_server.keys(PREFIX + "*") == []


def test_wire_encoding_is_the_only_format(server_config: dict[str, Any], redis_server: RedisServer) -> None:
    payload = {"t": torch.arange(10), "n": [1, "x"]}
    with create_connector("redis", server_config) as conn:
        conn.put(0, 1, "fmt", payload)
        element = _raw(redis_server).lindex(PayloadKeys(PREFIX, "fmt").manifest, 0)
        assert isinstance(element, bytes)
        decoded = wire.decode(bytearray(element[mf.HEADER_SIZE :]))
        assert torch.equal(decoded["t"], payload["t"]) and decoded["n"] == [1, "x"]
        assert b"pickle" not in element and b"\x80\x05" not in element[: mf.HEADER_SIZE + 2]
        assert conn.get(0, 1, "fmt") is not None


def test_unreachable_server_error_names_server_and_key() -> None:
    from omni_plugins_redis.testing import free_port

    port = free_port()
    config = {"port": port, "password": "pw-never-shown", "retry_attempts": 1, "retry_backoff": 0.01, "key_prefix": PREFIX}
    with create_connector("redis", config) as conn:
        with pytest.raises(ConnectorError) as info:
            conn.put(0, 1, "nowhere", {"v": 1})
        assert f"127.0.0.1:{port}" in str(info.value) and "'nowhere'" in str(info.value)
        assert "pw-never-shown" not in str(info.value)
        status = conn.health()
        assert status["ok"] is False and str(port) in status["error"]


def test_invalid_key_is_a_typed_error(server_config: dict[str, Any]) -> None:
    with create_connector("redis", server_config) as conn, pytest.raises(ConnectorError, match="non-empty"):
        conn.put(0, 1, "", {"v": 1})


def test_stale_cluster_slot_map_is_refreshed_on_moved(redis_cluster: RedisCluster, cluster_config: dict[str, Any]) -> None:
    with create_connector("redis", {**cluster_config, "startup_nodes": redis_cluster.startup_nodes[:1]}) as conn:
        assert conn.put(0, 1, "warm", {"v": 0}).ok  # loads the slot map
        nodes = conn._client.topology._cluster().nodes_manager  # type: ignore[attr-defined]  # redis-py's slot map
        wrong = nodes.slots_cache[0][0]
        nodes.slots_cache = {slot: [wrong] for slot in range(16384)}  # every slot "owned" by one node: others answer MOVED
        keys = [f"moved-{i}" for i in range(12)]
        for i, key in enumerate(keys):
            assert conn.put(0, 1, key, {"v": torch.full((1000,), float(i))}).ok
        for i, key in enumerate(keys):
            got = conn.get(0, 1, key)
            assert got is not None and torch.equal(got.data["v"], torch.full((1000,), float(i)))
        owners = {nodes.slots_cache[slot][0].name for slot in range(16384)}
        assert len(owners) == 3, "the map was refreshed from MOVED replies"
        assert conn.get(0, 1, "warm") is not None
    assert redis_cluster.keys(PREFIX + "*") == []


@pytest.mark.parametrize("lazy", [True, False])
def test_cleanup_keys_after_operations(redis_server: RedisServer, server_config: dict[str, Any], lazy: bool) -> None:
    with create_connector("redis", {**server_config, "lazy_cleanup": lazy}) as conn:
        assert conn.put(0, 1, "tidy", {"v": torch.arange(3)}).ok
        assert conn.get(0, 1, "tidy") is not None
        left = redis_server.keys(PREFIX + "*")
        if not lazy:
            deadline = time.monotonic() + 5  # sent at once; the server runs them right away
            while left and time.monotonic() < deadline:
                time.sleep(0.01)
                left = redis_server.keys(PREFIX + "*")
            assert left == []
        else:
            assert all(b":w:" in k or b":c:" in k for k in left)  # only small markers wait for the next write
    assert redis_server.keys(PREFIX + "*") == []


@pytest.mark.parametrize("target", ["standalone", "cluster"])
def test_wait_any_sees_a_later_put_without_consuming(target: str, request: pytest.FixtureRequest) -> None:
    config = request.getfixturevalue("server_config" if target == "standalone" else "cluster_config")
    keys = [f"any-{i}" for i in range(8)]
    with create_connector("redis", config) as conn, create_connector("redis", config) as producer:
        assert conn.wait_any(keys, timeout=0.05) == []
        timer = threading.Timer(0.2, lambda: producer.put(0, 1, keys[5], {"v": 5}))
        timer.start()
        ready = conn.wait_any(keys, timeout=10)
        timer.join()
        assert ready == [keys[5]]
        got = conn.get(0, 1, keys[5])
        assert got is not None and got.data == {"v": 5}


def _parts_of(server: RedisServer | RedisCluster, key: str) -> list[bytes]:
    return server.keys(PREFIX + "{" + key + "}:p:*")


def test_consumed_parts_go_with_the_next_parted_put(server_config: dict[str, Any], redis_server: RedisServer) -> None:
    """A get leaves its (unreachable) parts for the next parted put to delete one by one; any other write deletes them."""
    a, b = torch.randn(100_000), torch.randn(120_000)  # 400 / 480 KB: 7 and 8 parts
    with create_connector("redis", {**server_config, "chunk_bytes": SMALL_CHUNK}) as conn:
        assert conn.put(0, 1, "reuse-a", {"x": a}).ok
        got = conn.get(0, 1, "reuse-a")
        assert got is not None and torch.equal(got.data["x"], a)
        assert conn.put(0, 1, "reuse-b", {"x": b}).ok  # deletes a's parts, interleaved with its own
        assert _parts_of(redis_server, "reuse-a") == [] and len(_parts_of(redis_server, "reuse-b")) == 8
        got = conn.get(0, 1, "reuse-b")
        assert got is not None and torch.equal(got.data["x"], b)
        assert conn.get(0, 1, "reuse-b") is None  # consumed; this write also deletes b's parts
        assert conn.put(0, 1, "small", {"v": 1}).ok
        assert _parts_of(redis_server, "reuse-b") == []
        assert conn.get(0, 1, "small") is not None
    assert redis_server.keys(PREFIX + "*") == []


def test_parts_deleted_at_once_without_reuse(server_config: dict[str, Any], redis_server: RedisServer) -> None:
    x = torch.randn(100_000)
    with create_connector("redis", {**server_config, "chunk_bytes": SMALL_CHUNK, "reuse_part_memory": False}) as conn:
        assert conn.put(0, 1, "noreuse", {"x": x}).ok
        assert conn.get(0, 1, "noreuse") is not None
        conn.health()  # a round trip on another connection: the delete (sent with the get) has run by now
        assert _parts_of(redis_server, "noreuse") == []
    assert redis_server.keys(PREFIX + "*") == []


def test_consumed_parts_across_cluster_nodes(cluster_config: dict[str, Any], redis_cluster: RedisCluster) -> None:
    """Retired parts of several payloads (several hash tags) are deleted key by key: no CROSSSLOT, nothing left."""
    tensors = {f"xs{i}": torch.full((40_000,), float(i)) for i in range(6)}  # 160 KB each: 3 parts
    with create_connector("redis", {**cluster_config, "chunk_bytes": SMALL_CHUNK, "inline_bytes": 0}) as conn:
        for key, t in tensors.items():
            assert conn.put(0, 1, key, {"t": t}).ok
        for key, t in tensors.items():
            got = conn.get(0, 1, key)
            assert got is not None and torch.equal(got.data["t"], t)
        for key, t in tensors.items():  # later puts take over the consumed parts on their node
            assert conn.put(0, 1, key + "-2", {"t": t}).ok
            assert conn.get(0, 1, key + "-2") is not None
    assert redis_cluster.keys(PREFIX + "*") == []
