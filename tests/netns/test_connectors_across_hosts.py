"""Connectors between test hosts: producer on host a, consumer on host b, Redis and mooncake_master on host c.

Payloads cross hosts intact, also under 5 % packet loss and 20 ms delay on
every host's egress; a 10 s partition of the service host (Redis, or the
Mooncake master) while puts and gets are in flight: every call returns (a
failure within the connector's timeouts, or a success after the heal), every
acknowledged payload reaches the consumer intact, nothing is left behind.
"""

from __future__ import annotations

import sys
import uuid
from typing import TYPE_CHECKING, Any

import pytest
from _exchange import Outcome, exchange

from omni_plugins.testing.netns import TestHost, TestNetwork

if TYPE_CHECKING:
    from conftest import Service  # this directory's (the fixtures' type); not imported at run time: another
    # directory's conftest may be the module named "conftest" then

TE_SECRET = "netns-test-secret-0123456789abcdef"
PARTITION = 10.0  # seconds the service host is cut off


def _configs(name: str, net: TestNetwork, request: pytest.FixtureRequest, **tight: Any) -> tuple[dict[str, Any], Any]:
    a, b = net.host("a"), net.host("b")
    if name == "redis":
        redis: Service = request.getfixturevalue("redis_on_c")
        cfg = {"url": f"redis://{redis.address}/0", "password": redis.extra["password"], "key_prefix": f"net-{uuid.uuid4().hex[:8]}:", **tight}
        return cfg, cfg
    master: Service = request.getfixturevalue("master_on_c")
    if name == "mooncake-store":
        common = {"master_address": master.address, "local_buffer_size": "16MiB", **tight}
        return (
            {**common, "local_hostname": a.address, "global_segment_size": "128MiB"},
            {**common, "local_hostname": b.address, "global_segment_size": 0},
        )
    producer = {"local_hostname": a.address, "listen_address": f"{a.address}:0", "secret": TE_SECRET, "pool_size": "64MiB"}
    return producer, lambda address: {"local_hostname": b.address, "listen_address": None, "peers": [address], "secret": TE_SECRET}


def _leftovers(name: str, out: Outcome, request: pytest.FixtureRequest, config: dict[str, Any]) -> dict[str, int]:
    """What the connectors or their server still hold after the exchange (all zero when nothing leaked)."""
    left = {f"{role} staged": int(health.get("staged", 0)) for role, health in out.health.items()}
    left.update({f"{role} being read": int(health.get("being_read", 0)) for role, health in out.health.items()})
    if name == "redis":
        import redis as redis_py

        server: Service = request.getfixturevalue("redis_on_c")
        client = redis_py.Redis(host=server.host.address, port=server.port, password=str(server.extra["password"]), socket_timeout=10)
        try:
            left["redis keys"] = len(list(client.scan_iter(match=f"{config['key_prefix']}*")))
        finally:
            client.close()
    elif name == "mooncake-store":
        left["store objects"] = request.getfixturevalue("master_on_c").master_key_count()
    return left


def _connect(host: TestHost, address: str, port: int) -> bool:
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"
    return host.run([sys.executable, "-c", probe, address, str(port)], check=False).returncode == 0


def _assert_delivered(out: Outcome) -> None:
    """The workers ran to their end, and every acknowledged payload reached the consumer intact."""
    assert not out.failures, out.failures
    assert out.closed == {"producer", "consumer"}, f"still running: {out.running}"
    assert out.acknowledged, out.puts
    lost = {k: out.gets.get(k) for k in out.acknowledged if out.last_get(k) != "intact"}
    assert lost == {}, "acknowledged payloads not delivered intact"


@pytest.mark.parametrize("impaired", [False, True], ids=["clean", "loss5-delay20ms"])
@pytest.mark.parametrize("name", ["redis", "mooncake-store", "mooncake-te"])
def test_payloads_cross_hosts_intact(network: TestNetwork, name: str, impaired: bool, request: pytest.FixtureRequest) -> None:
    before = network.link_stats()
    if impaired:
        network.impair(loss=0.05, delay=0.02, seed=5)
    try:
        prod, cons = _configs(name, network, request)
        out = exchange(name, (network.host("a"), prod), (network.host("b"), cons), count=6)
    finally:
        network.clear_impairments()
    after = network.link_stats()
    lost = {h.name: after[h.address]["lost"] - before[h.address]["lost"] for h in network.hosts}
    assert (sum(lost.values()) > 0) is impaired, lost  # the loss was real: TCP had to retransmit
    _assert_delivered(out)
    assert len(out.acknowledged) == 6, out.puts
    assert [k for k, got in out.gets.items() if len(got) != 1] == []  # no get needed a retry
    assert _leftovers(name, out, request, prod) == dict.fromkeys(_leftovers(name, out, request, prod), 0)


# timeouts of the partition runs: a call waits this long for an unreachable server (the defaults are for real networks)
TIGHT = {"redis": {"connect_timeout": 2.0, "socket_timeout": 3.0}, "mooncake-store": {"connect_timeout": 2.0}}


@pytest.mark.parametrize("name", ["redis", "mooncake-store"])
def test_partition_from_the_service_host(network: TestNetwork, name: str, request: pytest.FixtureRequest) -> None:
    """Cut host c (Redis / mooncake_master) off for 10 s while a streams puts and b, 3 keys behind, gets them."""
    a, c = network.host("a"), network.host("c")
    service: Service = request.getfixturevalue("redis_on_c" if name == "redis" else "master_on_c")
    cut_off: list[bool] = []

    def cut() -> None:
        network.cut(c)
        cut_off.append(_connect(a, service.host.address, service.port) is False)

    prod, cons = _configs(name, network, request, **TIGHT[name])
    out = exchange(
        name,
        (network.host("a"), prod),
        (network.host("b"), cons),
        count=40,
        interval=0.25,
        get_timeout=5.0,
        patience=60.0,
        lag=3,
        faults=[(8, cut), (PARTITION, lambda: network.heal(c))],
        deadline=150.0,
    )
    _assert_delivered(out)
    assert cut_off == [True]  # the partition was real: host a could not reach the service meanwhile
    outcomes = [o for o, _, _ in out.puts.values()] + [o for attempts in out.gets.values() for o, _ in attempts]
    assert {o.split(":")[0] for o in outcomes} <= {"ok", "intact", "none", "ConnectorError"}  # failures are typed
    assert out.puts[max(out.puts, key=lambda k: int(k.rsplit("-", 1)[1]))][0] == "ok"  # the service is usable again after the heal
    assert _leftovers(name, out, request, prod) == dict.fromkeys(_leftovers(name, out, request, prod), 0)


def test_te_consumer_finds_a_producer_on_another_host_through_the_metadata_server(
    network: TestNetwork, request: pytest.FixtureRequest
) -> None:
    """No peers listed: the producer on a announces itself in the roster on c's metadata server, the consumer on b reads it.

    A stale entry (an address that refuses) sits in the roster too: it is skipped, not an error."""
    import json

    from omni_plugins_mooncake.te.roster import MetadataRoster

    master: Service = request.getfixturevalue("master_on_c")
    a, b = network.host("a"), network.host("b")
    group = f"g{uuid.uuid4().hex[:8]}"
    roster = MetadataRoster(str(master.extra["metadata_url"]), group)
    stale = f"{a.address}:1"  # nobody listens there; sorts first, so the first get asks it first
    roster.announce(stale)
    common = {"metadata_server": master.extra["metadata_url"], "discovery_group": group, "secret": TE_SECRET}
    producer = {**common, "local_hostname": a.address, "listen_address": f"{a.address}:0", "pool_size": "64MiB", "rendezvous_dir": None}
    consumer = {**common, "local_hostname": b.address, "listen_address": None, "rendezvous_dir": None}
    out = exchange("mooncake-te", (a, producer), (b, consumer), count=4)
    _assert_delivered(out)
    assert len(out.acknowledged) == 4
    assert [k for k, got in out.gets.items() if len(got) != 1] == []
    assert out.health["consumer"]["roster"]["peers"] == 2
    assert stale not in out.health["consumer"]["peers"]  # refused once, then skipped until its entry is renewed
    assert out.health["producer"]["staged"] == 0
    assert list(roster.read()) == [stale]  # the producer left the roster when it closed
    roster.withdraw(stale)
    assert roster.read() == {}
    assert json.dumps(out.health).count(TE_SECRET) == 0
