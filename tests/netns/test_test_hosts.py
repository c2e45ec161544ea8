"""The test-host kit: namespaces on a bridge, partitions, clean-up, and refusal outside the suite's namespace."""

from __future__ import annotations

import subprocess
import sys

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
    holders = [h._holder.pid for h in net.hosts]
    assert net.leftovers()
    net.close()
    assert sleeper.poll() is not None
    assert not [pid for pid in holders if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert net.leftovers() == [] and net.bridge not in psutil.net_if_addrs()


def test_refused_outside_the_suites_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_TEST_NETNS", raising=False)
    with pytest.raises(TestHostsUnavailable, match="OMNI_TEST_NETNS=confined"):
        TestNetwork(1)
    monkeypatch.setenv("OMNI_TEST_NETNS", "confined")
    monkeypatch.setattr(netns.psutil, "net_if_addrs", lambda: {"lo": [], "eth0": []})
    with pytest.raises(TestHostsUnavailable, match="besides lo"):
        TestNetwork(1)


def test_netem_works_or_says_why(network: TestNetwork) -> None:
    reason = network.netem_unavailable()
    if reason is not None:
        assert "netem" in reason
        pytest.skip(reason)
    network.impair(loss=0.05, delay=0.02)
    shown = network.hosts[0].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "netem" in shown and "delay 20" in shown and "loss 5%" in shown
