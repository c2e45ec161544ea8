"""Every server the test launchers start, and every socket our connectors open, listens on loopback only.

Listening sockets are read from the process itself (``psutil.Process(pid).net_connections``).
Known exception, asserted precisely rather than hidden: Mooncake's TransferEngine
(inside a ``mooncake-store`` client and a ``mooncake-te`` connector) listens on the
wildcard addresses ``0.0.0.0`` and ``::`` for its handshake RPC port and its TCP
transport port, whatever ``MC_TCP_BIND_ADDRESS`` says (mooncake 0.3.13.post1 has no
setting for it). What binds where, what was tried and the loopback-only network
namespace mitigation: docs/operations/security.md.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from omni_plugins.testing.netns import TEST_RANGE

LOOPBACK = {"127.0.0.1", "::1"}


def listening(pid: int, *, settle: float = 10.0) -> set[tuple[str, int]]:
    """(ip, port) of every LISTEN inet socket of ``pid`` (waits, bounded, until there is one)."""
    deadline = time.monotonic() + settle
    while True:
        found = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def assert_loopback(pid: int, what: str) -> set[tuple[str, int]]:
    found = listening(pid)
    assert found, f"{what} (pid {pid}) listens on nothing"
    wide = sorted(a for a in found if a[0] not in LOOPBACK)
    assert wide == [], f"{what} (pid {pid}) listens beyond loopback: {wide}"
    return found


@pytest.mark.parametrize("options", [{}, {"password": "pw-1"}, {"tls": True}], ids=["plain", "password", "tls"])
def test_redis_server_launcher(options: dict[str, object]) -> None:
    from omni_plugins_redis.testing import RedisServer

    with RedisServer(**options) as server:  # type: ignore[arg-type]
        assert server.pid is not None
        found = assert_loopback(server.pid, "redis-server")
        assert ("127.0.0.1", server.port) in found


def test_redis_cluster_launcher() -> None:
    from omni_plugins_redis.testing import RedisCluster

    with RedisCluster(masters=3) as cluster:
        for node in cluster.nodes:
            assert node.pid is not None
            found = assert_loopback(node.pid, "redis cluster node")
            assert {("127.0.0.1", node.port), ("127.0.0.1", node.port + 10000)} <= found  # client and cluster bus


def test_mooncake_master_launcher() -> None:
    pytest.importorskip("mooncake.store")
    from omni_plugins_mooncake.testing import MooncakeMaster

    with MooncakeMaster() as master:
        assert master.pid is not None
        found = assert_loopback(master.pid, "mooncake_master")
        assert ("127.0.0.1", master.rpc_port) in found


ENGINES = textwrap.dedent(
    """
    import json, os, sys, psutil
    from omni_plugins_mooncake.testing import loopback_environment
    loopback_environment()
    from omni_plugins import create_connector

    def listens():
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}

    out = {}
    base = listens()
    store = create_connector("mooncake-store", {"master_address": sys.argv[1], "global_segment_size": "32MiB", "local_buffer_size": "16MiB"})
    out["store"] = sorted(listens() - base)
    base = listens()
    te = create_connector("mooncake-te", {"pool_size": "32MiB"})
    out["te"] = sorted(listens() - base)
    out["te_control"] = te.health()["listen_address"]
    out["te_rpc_port"] = int(te.health()["segment"].rsplit(":", 1)[1])
    te.close(); store.close()
    out["after_close"] = sorted(listens())
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def engine_sockets() -> dict[str, object]:
    pytest.importorskip("mooncake.store")
    from omni_plugins_mooncake.testing import MooncakeMaster

    with MooncakeMaster() as master:
        proc = subprocess.run([sys.executable, "-c", ENGINES, master.address], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mooncake_connectors_own_sockets_are_loopback(engine_sockets: dict[str, object]) -> None:
    """What this project controls -- the mooncake-te control channel -- binds loopback; the rest is the engine."""
    control = str(engine_sockets["te_control"])
    host, port = control.rsplit(":", 1)
    assert host == "127.0.0.1"
    te = {tuple(a) for a in engine_sockets["te"]}  # type: ignore[union-attr]
    assert ("127.0.0.1", int(port)) in te
    # the known exception, pinned down: only wildcard binds, and one of them is the engine's RPC port
    for name in ("store", "te"):
        wide = {tuple(a) for a in engine_sockets[name] if a[0] not in LOOPBACK}  # type: ignore[union-attr]
        assert all(ip in ("0.0.0.0", "::") for ip, _ in wide), wide
        assert len(wide) <= 2, f"{name}: more non-loopback sockets than the engine's RPC + TCP transport ports: {wide}"
    assert any(p == engine_sockets["te_rpc_port"] for _, p in engine_sockets["te"])  # type: ignore[union-attr]


@pytest.mark.xfail(
    strict=True,
    reason="Mooncake TransferEngine (0.3.13.post1) binds its handshake port to 0.0.0.0 (INADDR_ANY, hard-coded) and its "
    "TCP data port to :: (dual-stack) whatever MC_TCP_BIND_ADDRESS, MC_LEGACY_RPC_PORT_BINDING, a host:port local_hostname "
    "or an HTTP metadata server say (all tried); mitigation: a loopback-only network namespace (docs/operations/security.md)",
)
def test_mooncake_engine_sockets_are_loopback(engine_sockets: dict[str, object]) -> None:
    for name in ("store", "te"):
        wide = [a for a in engine_sockets[name] if a[0] not in LOOPBACK]  # type: ignore[union-attr]
        assert wide == [], f"{name}: {wide}"


IN_NAMESPACE = textwrap.dedent(
    """
    import json, socket, psutil, torch
    from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment
    loopback_environment()
    from omni_plugins import create_connector

    out = {"interfaces": sorted(name for _, name in socket.if_nameindex())}
    with MooncakeMaster() as master:
        store = {"master_address": master.address, "global_segment_size": "32MiB", "local_buffer_size": "16MiB"}
        pairs = {
            "mooncake-store": (store, {**store, "global_segment_size": 0}),
            "mooncake-te": ({"pool_size": "32MiB"}, None),
        }
        for name, (prod_cfg, cons_cfg) in pairs.items():
            producer = create_connector(name, prod_cfg)
            consumer = create_connector(name, cons_cfg or {"listen_address": None, "peers": [producer.address]})
            producer.put(0, 1, "k", {"v": torch.arange(1000)})
            got = consumer.get(0, 1, "k", timeout=10)
            out[name] = got is not None and torch.equal(got.data["v"], torch.arange(1000))
            out[name + " listens"] = sorted(
                {c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
            )
            del got
            consumer.close(); producer.close()
    print(json.dumps(out))
    """
)


def test_mooncake_mitigation_loopback_only_network_namespace() -> None:
    """The documented mitigation works: in a namespace with only ``lo`` the wildcard listeners reach loopback only."""
    pytest.importorskip("mooncake.store")
    from omni_plugins_mooncake.testing import loopback_namespace_available, loopback_namespace_command

    if not loopback_namespace_available():
        pytest.skip("no unprivileged user + network namespaces here (unshare/ip)")
    proc = subprocess.run(
        loopback_namespace_command([sys.executable, "-c", IN_NAMESPACE]), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["interfaces"] == ["lo"]  # nothing but loopback can reach a socket in here
    assert out["mooncake-store"] is True and out["mooncake-te"] is True  # and the connectors still move data
    # the engines still bind wildcards in there (what the namespace is for)
    assert {"0.0.0.0", "::"} & set(out["mooncake-te listens"])


@pytest.mark.skipif(
    os.environ.get("OMNI_TEST_NETNS") != "confined",
    reason="the suite runs unconfined (OMNI_TEST_NETNS=0, or no user namespaces where scripts/setup.sh test ran)",
)
def test_test_suite_runs_where_only_loopback_exists(engine_sockets: dict[str, object]) -> None:
    """``scripts/setup.sh test`` runs pytest in a network namespace whose only interface is ``lo``: every
    listener a test starts -- Mooncake's wildcard ones included -- is reachable through loopback alone,
    and nothing a test does can send traffic to another host."""
    addresses = psutil.net_if_addrs()
    # Besides lo, only the links of test networks another test of this run may hold open at the same
    # moment (parallel workers share the namespace): named omt..., addressed from the benchmarking range.
    test_links = {name: addrs for name, addrs in addresses.items() if name != "lo"}
    assert all(name.startswith("omt") for name in test_links), sorted(addresses)
    for addrs in test_links.values():
        ipv4 = [ipaddress.ip_address(a.address) for a in addrs if a.family == socket.AF_INET]
        assert all(ip in TEST_RANGE for ip in ipv4), ipv4
        assert not [a for a in addrs if a.family == socket.AF_INET6], addrs
    assert {a.address for a in addresses["lo"] if a.family in (socket.AF_INET, socket.AF_INET6)} <= LOOPBACK
    wildcard = {tuple(a) for name in ("store", "te") for a in engine_sockets[name] if a[0] in ("0.0.0.0", "::")}  # type: ignore[union-attr]
    assert wildcard, "expected the engine's wildcard listeners (else drop this test and the xfail above)"
    with pytest.raises(OSError):  # no route anywhere but loopback (TEST-NET-1 address, never sent if routed)
        socket.create_connection(("192.0.2.1", 9), timeout=1).close()
