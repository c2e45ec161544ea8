"""A primary SIGKILLed mid-stream: Redis Cluster (3 primaries + 3 replicas) and Sentinel (1 primary + 2 replicas + 3 Sentinels).

A producer and a consumer (their own connectors, so their own connections)
stream payloads whose keys all live on the primary that is killed. Its replica
takes over; the pipeline finishes. Every payload whose ``put`` returned ok is
counted against what the consumer received: with ``min_replica_acks`` equal to
the replicas that may be promoted (the cluster's one per primary, Sentinel's
two) none may be missing; without it Redis's asynchronous replication may lose
the last acknowledged writes, and the test reports how many
(``record_property`` and a warning) instead of hiding them. Nothing of the
stream may be left on any node.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from omni_plugins_redis.connector import acl_rule
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.testing import RedisCluster, RedisSentinelGroup, RedisServer

from omni_plugins import create_connector
from omni_plugins.errors import ConnectorError

ADMIN_PW = "admin-Secret-1"
APP_PW = "app-Secret-2"
PAYLOADS = 36
# Healthy replicas confirm within milliseconds, but a loaded machine can delay that by more than a second; a put
# that falls short (while the promoted primary has too few replicas) fails after this and is sent again.
ACK_TIMEOUT = 10.0
# Fast retries that outlast a failover (a few seconds) and, with acks, the wait for the revived replica.
RESILIENT = {
    "retry_attempts": 60,
    "retry_backoff": 0.05,
    "retry_backoff_max": 0.5,
    "socket_timeout": 2 * ACK_TIMEOUT,
    "connect_timeout": 1.0,
}
# A write confirmed by fewer replicas than may be promoted can be missing on the one Sentinel promotes (it ranks
# replicas by the replication offset they last reported): no loss is asserted with every replica confirming.
SENTINEL_REPLICAS = 2


@dataclass
class Stream:
    """What a producer/consumer pair saw of one stream."""

    keys: list[str]
    unread: str = ""
    acked: set[int] = field(default_factory=set)
    received: dict[int, Any] = field(default_factory=dict)
    put_failures: int = 0
    get_failures: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def lost(self) -> list[int]:
        return sorted(self.acked - set(self.received))


def _payload(i: int) -> dict[str, Any]:
    size = 300_000 if i % 2 else 1_000  # parted (5 parts of 64 KiB) and inline
    return {"i": i, "v": torch.full((size // 4,), float(i))}


def _keys_on(prefix: str, owns: Callable[[int], bool], count: int) -> list[str]:
    """``count`` stream keys whose slot ``owns`` accepts (all on the primary that will be killed)."""
    run = uuid.uuid4().hex[:6]
    keys = (f"fo-{run}-{n}" for n in range(1_000_000))
    return [k for k in keys if owns(PayloadKeys(prefix, k).slot)][: count + 1]


def _stream(config: dict[str, Any], keys: list[str], failover: Callable[[], None], *, kill_after: int) -> Stream:
    """Producer and consumer threads stream ``keys[1:]``; ``failover()`` runs once ``kill_after`` payloads arrived.

    ``keys[0]`` is put before and never read: an unread payload whose keys must
    keep their TTL on the promoted node (checked by :func:`_check_ttls`).
    """
    with create_connector("redis", config) as conn:
        assert conn.put(0, 1, keys[0], _payload(1)).ok
    stream = Stream(keys[1:], unread=keys[0])
    keys = stream.keys
    produced = threading.Event()
    progress = threading.Semaphore(0)

    def produce() -> None:
        with create_connector("redis", config) as conn:
            for i, key in enumerate(keys):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # a put that failed is sent again, as the runtime does
                    try:
                        if conn.put(0, 1, key, _payload(i)).ok:
                            stream.acked.add(i)
                            break
                    except ConnectorError as exc:
                        stream.put_failures += 1
                        stream.errors.append(f"put {i}: {exc}")
                        time.sleep(0.05)
                time.sleep(0.02)
        produced.set()

    def consume() -> None:
        with create_connector("redis", config) as conn:
            for i, key in enumerate(keys):
                last_try = False
                while True:
                    try:
                        got = conn.get(0, 1, key, timeout=0.5)
                    except ConnectorError as exc:
                        stream.get_failures += 1
                        stream.errors.append(f"get {i}: {exc}")
                        continue
                    if got is not None:
                        stream.received[i] = got.data
                        progress.release()
                        break
                    if last_try:  # never put, or lost: counted by the caller
                        break
                    last_try = produced.is_set()

    threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
    for thread in threads:
        thread.start()
    for _ in range(kill_after):
        assert progress.acquire(timeout=60), f"the stream stalled before the failover: {stream.errors[-3:]}"
    failover()
    for thread in threads:
        thread.join(180)
    assert not any(t.is_alive() for t in threads), f"the stream hung across the failover: {stream.errors[-3:]}"
    return stream


def _check(stream: Stream, *, acks: int, record: Callable[[str, object], None]) -> None:
    for i, data in stream.received.items():
        assert data["i"] == i and torch.equal(data["v"], _payload(i)["v"]), f"payload {i} damaged"
    record("acknowledged", len(stream.acked))
    record("acknowledged_lost", len(stream.lost))
    record("put_failures", stream.put_failures)
    assert stream.acked, "nothing was acknowledged"
    assert set(stream.received) <= stream.acked, "a payload whose put failed was delivered"
    if acks:
        assert stream.lost == [], f"acknowledged payloads lost with min_replica_acks={acks}: {stream.lost}"
        assert len(stream.acked) == len(stream.keys), "the producer gave up on a payload"
    elif stream.lost:
        warnings.warn(
            f"{len(stream.lost)} of {len(stream.acked)} acknowledged payloads lost in the failover without min_replica_acks "
            f"(Redis replicates asynchronously): {stream.lost}",
            stacklevel=2,
        )


def _check_ttls(nodes: list[RedisServer], config: dict[str, Any], unread: str) -> None:
    """The unread payload put before the failover expires on every node that has it, then goes with cleanup()."""
    pattern = f"{config['key_prefix']}{{{unread}}}*"
    ttls: dict[bytes, int] = {}
    for node in nodes:
        client = node.client(single_connection_client=True)
        try:
            if config.get("cluster"):
                client.execute_command("READONLY")  # a cluster replica answers key reads only after READONLY
            ttls.update({key: client.pttl(key) for key in client.scan_iter(match=pattern)})
        finally:
            client.close()
    assert any(key.endswith(b":m") for key in ttls) and any(b":p:" in key for key in ttls), f"the unread payload is gone: {ttls}"
    assert all(ttl > 0 for ttl in ttls.values()), f"keys without a TTL after the failover: {ttls}"
    with create_connector("redis", config) as conn:
        assert conn.cleanup(unread) is True


def _wait_no_keys_or_expiring(group: RedisSentinelGroup, pattern: str) -> None:
    """Without ``min_replica_acks`` a failover can lose a put's manifest or a get's final delete while their parts
    or claim list reached the promoted node: nothing can find those keys any more, and each carries its expiry
    (``ttl_seconds``, the claim's TTL), so they go by themselves. Any other key left is a leak. The expiring ones
    are removed so the next test starts clean."""
    deadline = time.monotonic() + 10
    while (left := group.keys(pattern)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not left:
        return
    client = group.current_primary().client()
    try:
        forever = [k for k in left if client.pttl(k) == -1]
        assert forever == [], f"keys left behind without an expiry: {forever[:10]}"
        client.delete(*left)
    finally:
        client.close()


def _wait_no_keys(topology: RedisCluster | RedisSentinelGroup, pattern: str) -> None:
    """No key of the stream on any node (replicas apply the last deletes asynchronously: bounded wait)."""
    deadline = time.monotonic() + 10
    left = topology.keys(pattern)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = topology.keys(pattern)
    assert left == [], f"keys left behind: {left[:10]}"


# -- Redis Cluster ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated_cluster(track_server: Any) -> Iterator[RedisCluster]:
    with RedisCluster(masters=3, replicas=1, node_timeout_ms=1500) as cluster:
        track_server(cluster)
        yield cluster


def _cluster_failover(cluster: RedisCluster, config: dict[str, Any], prefix: str, track: Any) -> Stream:
    victim = cluster.primary_of(PayloadKeys(prefix, "anchor").slot)
    ranges = _slot_ranges(victim)
    keys = _keys_on(prefix, lambda slot: any(start <= slot <= end for start, end in ranges), PAYLOADS)

    def failover() -> None:
        cluster.kill(victim)
        cluster.wait_promoted(PayloadKeys(prefix, keys[0]).slot, victim)
        cluster.revive(victim)  # back as the new primary's replica: acknowledged writes can reach a replica again
        track(cluster)

    return _stream(config, keys, failover, kill_after=PAYLOADS // 3)


def _slot_ranges(node: RedisServer) -> list[tuple[int, int]]:
    """The slot ranges ``node`` serves as a primary."""
    client = node.client()
    try:
        return [(int(e[0]), int(e[1])) for e in client.execute_command("CLUSTER", "SLOTS") if int(e[2][1]) == node.port]
    finally:
        client.close()


@pytest.mark.parametrize("acks", [1, 0], ids=["min_replica_acks=1", "no-acks"])
def test_cluster_primary_killed_mid_stream(
    replicated_cluster: RedisCluster, track_server: Any, record_property: Callable[[str, object], None], acks: int
) -> None:
    prefix = f"fo{uuid.uuid4().hex[:6]}:"
    config = replicated_cluster.connector_config(
        key_prefix=prefix, chunk_bytes=64 * 1024, min_replica_acks=acks, replica_ack_timeout=ACK_TIMEOUT, **RESILIENT
    )
    stream = _cluster_failover(replicated_cluster, config, prefix, track_server)
    _check(stream, acks=acks, record=record_property)
    if acks:
        _check_ttls(replicated_cluster.live_nodes, config, stream.unread)
    else:  # without min_replica_acks it may not have survived the failover: just remove it
        with create_connector("redis", config) as conn:
            conn.cleanup(stream.unread)
    _wait_no_keys(replicated_cluster, prefix + "*")


@pytest.fixture(scope="module")
def tls_acl_cluster(track_server: Any) -> Iterator[RedisCluster]:
    users = [f"app on >{APP_PW} {acl_rule('fotls', cluster=True)}"]
    with RedisCluster(masters=3, replicas=1, node_timeout_ms=1500, tls=True, password=ADMIN_PW, acl_users=users) as cluster:
        track_server(cluster)
        yield cluster


def test_cluster_over_tls_as_a_least_privilege_user(
    tls_acl_cluster: RedisCluster, track_server: Any, record_property: Callable[[str, object], None]
) -> None:
    """TLS everywhere (clients, replication, cluster bus) and an ACL user limited to its prefix: the failover still loses nothing."""
    prefix = f"fotls-{uuid.uuid4().hex[:6]}:"
    config = tls_acl_cluster.connector_config(
        key_prefix=prefix,
        username="app",
        password=APP_PW,
        chunk_bytes=64 * 1024,
        min_replica_acks=1,
        replica_ack_timeout=ACK_TIMEOUT,
        **RESILIENT,
    )
    assert config["tls"] is True
    stream = _cluster_failover(tls_acl_cluster, config, prefix, track_server)
    _check(stream, acks=1, record=record_property)
    _check_ttls(tls_acl_cluster.live_nodes, config, stream.unread)
    _wait_no_keys(tls_acl_cluster, prefix + "*")


# -- Sentinel --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel_group(track_server: Any) -> Iterator[RedisSentinelGroup]:
    with RedisSentinelGroup(replicas=SENTINEL_REPLICAS, sentinels=3, down_after_ms=1000) as group:
        _track_group(track_server, group)
        yield group


def _track_group(track_server: Any, group: RedisSentinelGroup) -> None:
    for node in [*group.data_nodes, *group.sentinels]:
        track_server(node)


def _sentinel_failover(group: RedisSentinelGroup, config: dict[str, Any], track: Any) -> Stream:
    keys = _keys_on(str(config["key_prefix"]), lambda slot: True, PAYLOADS)

    def failover() -> None:
        old = group.kill_primary()
        group.wait_failover(old)
        old.start()  # the Sentinels turn it into a replica of the new primary
        track(old)
        group.wait_healthy()  # resynced: the group is whole again for the rest of the stream and the next test

    return _stream(config, keys, failover, kill_after=PAYLOADS // 3)


@pytest.mark.parametrize("acks", [SENTINEL_REPLICAS, 0], ids=[f"min_replica_acks={SENTINEL_REPLICAS}", "no-acks"])
def test_sentinel_primary_killed_mid_stream(
    sentinel_group: RedisSentinelGroup, track_server: Any, record_property: Callable[[str, object], None], acks: int
) -> None:
    prefix = f"fo{uuid.uuid4().hex[:6]}:"
    config = sentinel_group.connector_config(
        key_prefix=prefix, chunk_bytes=64 * 1024, min_replica_acks=acks, replica_ack_timeout=ACK_TIMEOUT, **RESILIENT
    )
    stream = _sentinel_failover(sentinel_group, config, track_server)
    _check(stream, acks=acks, record=record_property)
    if acks:
        _check_ttls(sentinel_group.data_nodes, config, stream.unread)
        _wait_no_keys(sentinel_group, prefix + "*")
    else:  # without min_replica_acks it may not have survived the failover: just remove it
        with create_connector("redis", config) as conn:
            conn.cleanup(stream.unread)
        _wait_no_keys_or_expiring(sentinel_group, prefix + "*")


@pytest.fixture(scope="module")
def tls_acl_sentinel_group(track_server: Any) -> Iterator[RedisSentinelGroup]:
    users = [f"app on >{APP_PW} {acl_rule('fotls')}"]
    with RedisSentinelGroup(
        replicas=SENTINEL_REPLICAS, sentinels=3, down_after_ms=1000, tls=True, password=ADMIN_PW, acl_users=users
    ) as group:
        _track_group(track_server, group)
        yield group


def test_sentinel_over_tls_as_a_least_privilege_user(
    tls_acl_sentinel_group: RedisSentinelGroup, track_server: Any, record_property: Callable[[str, object], None]
) -> None:
    """TLS to the Sentinels and the data nodes, an ACL user limited to its prefix: the failover still loses nothing."""
    prefix = f"fotls-{uuid.uuid4().hex[:6]}:"
    config = tls_acl_sentinel_group.connector_config(
        key_prefix=prefix,
        username="app",
        password=APP_PW,
        chunk_bytes=64 * 1024,
        min_replica_acks=SENTINEL_REPLICAS,
        replica_ack_timeout=ACK_TIMEOUT,
        **RESILIENT,
    )
    assert config["tls"] is True
    stream = _sentinel_failover(tls_acl_sentinel_group, config, track_server)
    _check(stream, acks=SENTINEL_REPLICAS, record=record_property)
    _check_ttls(tls_acl_sentinel_group.data_nodes, config, stream.unread)
    _wait_no_keys(tls_acl_sentinel_group, prefix + "*")


def test_sentinel_switchover_with_the_old_primary_alive(sentinel_group: RedisSentinelGroup) -> None:
    """``SENTINEL FAILOVER``: the old primary lives on as a replica. Pooled connections to it answer READONLY (a
    write) or UNBLOCKED (a blocked BLMOVE); the connector drops them and follows the new primary, losing nothing."""
    prefix = f"sw{uuid.uuid4().hex[:6]}:"
    config = sentinel_group.connector_config(
        key_prefix=prefix, min_replica_acks=SENTINEL_REPLICAS, replica_ack_timeout=ACK_TIMEOUT, **RESILIENT
    )
    sentinel_group.wait_healthy()  # every replica back from an earlier test's failover: both must ack each put
    blocked: list[Any] = []
    with create_connector("redis", config) as writer, create_connector("redis", config) as reader:
        for i in range(4):  # several pooled connections to the current primary
            assert writer.put(0, 1, f"before-{i}", {"v": i}).ok
        waiting = threading.Thread(target=lambda: blocked.append(reader.get(0, 1, "during", timeout=30)))
        waiting.start()  # blocked in BLMOVE on the old primary
        old = sentinel_group.current_primary()
        sentinel = sentinel_group.sentinels[0].client()
        try:
            sentinel.execute_command("SENTINEL", "FAILOVER", sentinel_group.service_name)
        finally:
            sentinel.close()
        sentinel_group.wait_failover(old)
        assert old.process is not None and old.process.poll() is None, "the old primary should still run"
        assert writer.put(0, 1, "during", {"v": "during"}).ok
        waiting.join(60)
        assert not waiting.is_alive() and blocked and blocked[0] is not None and blocked[0].data == {"v": "during"}
        for i in range(4):
            got = reader.get(0, 1, f"before-{i}", timeout=5)
            assert got is not None and got.data == {"v": i}
    _wait_no_keys(sentinel_group, prefix + "*")
