"""The test-host kit: namespaces on forwarded links, loss, delay, partitions, clean-up, refusal outside the suite's namespace."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from omni_plugins.testing import netns
from omni_plugins.testing.netns import TestHostsUnavailable, TestNetwork, test_hosts_unavailable

PROBE = "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])); print('ok')"


@pytest.fixture
def network() -> TestNetwork:
    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with TestNetwork(3) as net:
        yield net
    assert net.leftovers() == []


def _connect(host: netns.TestHost, address: str, port: int, timeout: float = 2.0) -> subprocess.CompletedProcess[str]:
    return host.run([sys.executable, "-c", PROBE, address, str(port), str(timeout)], check=False)


def test_hosts_have_only_their_test_address_and_reach_each_other(network: TestNetwork) -> None:
    a, b, c = network.hosts
    assert [h.address for h in network.hosts] == [str(network.subnet[i]) for i in (1, 2, 3)]
    assert network.subnet.subnet_of(netns.TEST_RANGE)
    shown = a.run(["ip", "-o", "-4", "addr", "show"]).stdout
    assert sorted(line.split()[1] for line in shown.splitlines()) == ["eth0", "lo"]
    assert f"{a.address}/24" in shown
    assert "inet6" not in a.run(["ip", "-o", "addr", "show", "dev", "eth0"]).stdout  # IPv4 only on the test links
    port = c.free_port()
    server = c.serve([sys.executable, "-m", "http.server", "--bind", c.address, str(port)], port=port, stderr=subprocess.DEVNULL)
    assert _connect(a, c.address, port).stdout.strip() == "ok"
    assert _connect(b, c.address, port).stdout.strip() == "ok"
    assert _connect(a, "127.0.0.1", port).returncode != 0  # c's server is not on a's loopback: separate hosts
    assert server.poll() is None


def test_isolate_drops_silently_then_heals(network: TestNetwork) -> None:
    a, b, c = network.hosts
    port = c.free_port()
    c.serve([sys.executable, "-m", "http.server", "--bind", c.address, str(port)], port=port, stderr=subprocess.DEVNULL)
    with network.isolate(c):
        cut = _connect(a, c.address, port, timeout=1.0)
        assert cut.returncode != 0 and "timed out" in cut.stderr  # dropped, not refused
        assert _connect(a, b.address, 9, timeout=1.0).stderr.count("refused") == 1  # a and b still talk (b refuses port 9)
    assert _connect(a, c.address, port).stdout.strip() == "ok"


def test_python_targets_run_inside_a_host(network: TestNetwork) -> None:
    from omni_plugins.testing.processes import process_context

    ctx = process_context()
    a = network.hosts[0]
    queue = ctx.Queue()
    proc = a.process(ctx, _report_addresses, queue)
    proc.start()
    addresses = queue.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    assert addresses == {"lo": ["127.0.0.1"], "eth0": [a.address]}


def _report_addresses(queue: object) -> None:
    import socket

    import psutil

    out = {name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()}
    queue.put(out)  # type: ignore[attr-defined]


def test_close_stops_every_process_and_removes_every_link() -> None:
    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    net = TestNetwork(2)
    sleeper = net.hosts[0].popen(["sleep", "600"])
    pids = [h._holder.pid for h in net.hosts] + [net.forwarder_pid]
    assert net.leftovers()
    net.close()
    assert sleeper.poll() is not None
    assert not [pid for pid in pids if _alive(pid)]
    assert net.leftovers() == [] and net.gateway_link not in psutil.net_if_addrs()


def test_refused_outside_the_suites_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_TEST_NETNS", raising=False)
    with pytest.raises(TestHostsUnavailable, match="OMNI_TEST_NETNS=confined"):
        TestNetwork(1)
    monkeypatch.setenv("OMNI_TEST_NETNS", "confined")
    monkeypatch.setattr(netns.psutil, "net_if_addrs", lambda: {"lo": [], "eth0": []})
    with pytest.raises(TestHostsUnavailable, match="besides lo"):
        TestNetwork(1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _udp_sink(host: netns.TestHost, port: int) -> subprocess.Popen[str]:
    """A process on ``host`` that prints the sequence numbers of the datagrams it gets (until 1 s of silence)."""
    proc = host.popen([sys.executable, "-c", SINK, host.address, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


SINK = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
got = [int(s.recv(100))]
s.settimeout(1.0)
try:
    while True:
        got.append(int(s.recv(100)))
except TimeoutError:
    pass
print(json.dumps(got))
"""
SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(str(i).encode(), (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.001)  # paced: the receiver's socket buffer must not be what drops them
"""
ECHO_RTT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(10)
started = time.monotonic()
s.sendto(b"ping", (sys.argv[1], int(sys.argv[2])))
s.recv(100)
print(time.monotonic() - started)
"""
ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
data, peer = s.recvfrom(100)
s.sendto(data, peer)
"""


def test_loss_drops_that_share_of_packets_and_keeps_order(network: TestNetwork) -> None:
    a, b, _ = network.hosts
    network.impair([a], loss=0.25, seed=7)  # a's egress only; seeded: the same draws every run
    before = network.link_stats()
    sink = _udp_sink(b, 9000)
    a.run([sys.executable, "-c", SEND, b.address, "9000", "400"])
    got = json.loads(sink.communicate(timeout=30)[0])
    after = network.link_stats()
    sent = after[a.address]["sent"] - before[a.address]["sent"]
    lost = after[a.address]["lost"] - before[a.address]["lost"]
    assert sent == 400  # nothing else left host a: no IPv6, no ARP on these links
    assert got == sorted(got) and len(set(got)) == len(got)  # in order, none twice
    assert lost == 400 - len(got)
    assert 60 < lost < 140  # 25 % of 400 give or take (the seeded draws give one fixed count)
    assert after[b.address]["delivered"] - before[b.address]["delivered"] == len(got)


def test_delay_holds_every_packet_on_each_way(network: TestNetwork) -> None:
    a, b, _ = network.hosts
    network.impair(delay=0.1)  # every host's egress: a round trip crosses two of them
    echo = b.popen([sys.executable, "-c", ECHO, b.address, "9001"], stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None and echo.stdout.readline() == "ready\n"
    rtt = float(a.run([sys.executable, "-c", ECHO_RTT, b.address, "9001"]).stdout)
    assert rtt >= 0.2  # a lower bound: the forwarder never delivers early, and load only adds to it
    assert echo.wait(10) == 0


def test_partition_drops_packets_on_their_way(network: TestNetwork) -> None:
    """A cut also drops what the delay still holds: a partition is a partition from the moment it starts."""
    a, b, _ = network.hosts
    network.impair([a], delay=1.0)
    sink = _udp_sink(b, 9003)
    network.cut(b)
    a.run([sys.executable, "-c", SEND, b.address, "9003", "1"])  # dropped on its way in
    assert network.link_stats()[a.address]["partitioned"] == 1
    network.heal(b)
    sender = a.popen(
        [sys.executable, "-c", SEND + "\nprint('sent', flush=True)", b.address, "9003", "1"], stdout=subprocess.PIPE, text=True
    )
    assert sender.stdout is not None and sender.stdout.readline() == "sent\n"  # held for 1 s ...
    network.cut(b)
    deadline = time.monotonic() + 30
    while network.link_stats()[a.address]["partitioned"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # ... and dropped when due, since b is cut off by then
    network.heal(b)
    network.impair([a])
    a.run([sys.executable, "-c", SEND, b.address, "9003", "3"])
    got = json.loads(sink.communicate(timeout=30)[0])
    assert got == [0, 1, 2]  # only the datagrams sent after the last heal
    assert network.link_stats()[a.address]["partitioned"] == 2


def test_nothing_leaves_the_test_links(network: TestNetwork) -> None:
    a = network.hosts[0]
    outside = a.run([sys.executable, "-c", SEND, "192.0.2.1", "9", "1"], check=False)  # TEST-NET-1, not ours
    assert outside.returncode != 0 and "unreachable" in outside.stderr  # a host has a route to its /24 only
    before = network.link_stats()[a.address]["unroutable"]
    a.run([sys.executable, "-c", SEND, str(network.subnet[99]), "9", "1"])  # in the subnet, but no host there
    assert network.link_stats()[a.address]["unroutable"] == before + 1


def test_a_killed_test_process_leaves_no_forwarder_host_or_link() -> None:
    """SIGKILL the process that made a network: its forwarder and hosts die with it, and the links go with them."""
    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None
    made = json.loads(maker.stdout.readline())
    assert made["links"] and all(_alive(pid) for pid in made["pids"])
    maker.kill()
    maker.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ([p for p in made["pids"] if _alive(p)] or set(made["links"]) & set(psutil.net_if_addrs())):
        time.sleep(0.05)
    assert [p for p in made["pids"] if _alive(p)] == []
    assert set(made["links"]) & set(psutil.net_if_addrs()) == set()


MAKER = """
import json, time
from omni_plugins.testing.netns import TestNetwork
net = TestNetwork(2)
pids = [h._holder.pid for h in net.hosts] + [net.forwarder_pid]
print(json.dumps({"pids": pids, "links": net.leftovers()}), flush=True)
time.sleep(600)
"""


def test_networks_of_two_processes_get_different_subnets() -> None:
    """Each pytest-xdist worker makes its networks in the one namespace of the suite: their subnets must not meet,
    even when both processes would pick the same one (the other process here starts from this one's)."""
    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with TestNetwork(1) as mine:
        other = subprocess.run([sys.executable, "-c", SAME_PICK, str(mine.index)], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout)["subnet"] != str(mine.subnet)


SAME_PICK = """
import itertools, json, sys
from omni_plugins.testing import netns
netns._networks = itertools.count(int(sys.argv[1]))  # the pick this process would make: the one in use
with netns.TestNetwork(1) as net:
    print(json.dumps({"subnet": str(net.subnet)}))
"""
