"""Test hosts: child network namespaces on a bridge, for multi-host tests on one machine.

A :class:`TestNetwork` makes ``n`` hosts, each its own network namespace with
``lo`` and one ``eth0`` (a veth pair whose other end is a port of a bridge),
addressed from the benchmarking range 198.18.0.0/15; the bridge gets the
network's ``.254`` address, so the test process itself reaches every host.
Processes run inside a host (:meth:`TestHost.popen`, :meth:`TestHost.run`,
:meth:`TestHost.process` for a Python target), links can be impaired with
``tc netem`` (:meth:`TestNetwork.impair`) and hosts cut off and healed
(:meth:`TestNetwork.isolate`). Closing the network stops every process it
started, and the namespaces and links go with them. Example::

    from omni_plugins.testing.netns import TestNetwork, test_hosts_unavailable

    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with TestNetwork(3) as net:
        a, b, c = net.hosts
        server = c.serve(["redis-server", "--bind", c.address, "--port", "7000", "--save", ""], port=7000)
        with net.isolate(c):          # c unreachable: packets to and from it are dropped silently
            ...
        net.impair(loss=0.05, delay=0.02)   # every host's egress: 5 % loss, 20 ms delay

Safety: a network is only made inside the test suite's own network namespace
(``scripts/setup.sh test`` runs pytest in one whose only interface is ``lo`` and
says so with ``OMNI_TEST_NETNS=confined``), never in a machine's real one:
outside it every constructor raises :class:`TestHostsUnavailable` and
:func:`test_hosts_unavailable` gives the reason to skip with. Nothing sends to
any address but loopback and the network's own 198.18.x.0/24.

How it works without root on the machine: the suite's namespace belongs to a
user namespace where the test process is root, so it may create veths and
bridges there and new network namespaces below it. A host's namespace is held
by a ``sleep`` process started with ``unshare --net`` (no ``ip netns add``,
which would need a writable ``/run/netns`` mount); commands enter it with
``nsenter --net=/proc/PID/ns/net``, Python targets with ``setns(2)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

#: the benchmarking range (RFC 2544): never routed on the internet, and only ever on these test links here
TEST_RANGE = ipaddress.ip_network("198.18.0.0/15")
_PREFIX = "omt"  # every link this module makes is named omt<network>...; nothing else is ever touched
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_networks = itertools.count()


class TestHostsUnavailable(RuntimeError):
    """Test hosts cannot be made here; the message says why (tests skip with it)."""

    __test__ = False  # not a test class, whatever pytest thinks of the name


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """Before exec in a child: SIGKILL when the starting process dies, so no host outlives a killed test run."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _own_links() -> set[str]:
    return {name for name in psutil.net_if_addrs() if name.startswith(_PREFIX)}


def confinement_problem() -> str | None:
    """Why this process is not in the suite's own network namespace, or None when it is."""
    if os.environ.get("OMNI_TEST_NETNS") != "confined":
        return (
            "not inside the test suite's own network namespace (OMNI_TEST_NETNS=confined, set by "
            "`bash scripts/setup.sh test`): test hosts are never made in a machine's real network namespace"
        )
    others = set(psutil.net_if_addrs()) - {"lo"} - _own_links()
    if others:
        return f"OMNI_TEST_NETNS=confined, but this network namespace has interfaces besides lo: {sorted(others)}"
    return None


def _run(argv: Sequence[str], *, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def _checked(argv: Sequence[str], *, timeout: float = 30.0) -> str:
    done = _run(argv, timeout=timeout)
    if done.returncode != 0:
        raise TestHostsUnavailable(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


_probe_result: str | bool | None = False  # False: not probed yet


def test_hosts_unavailable() -> str | None:
    """The reason test hosts cannot be made here (to skip with), or None when they can. Probed once per process."""
    global _probe_result
    if _probe_result is not False:
        return _probe_result  # type: ignore[return-value]
    reason = confinement_problem()
    if reason is None:
        missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
        if missing:
            reason = f"missing {', '.join(missing)} (Debian: iproute2, util-linux)"
    if reason is None:
        try:
            with TestNetwork(1):
                pass
        except TestHostsUnavailable as exc:
            reason = f"the kernel refuses test hosts here: {exc}"
    _probe_result = reason
    return reason


test_hosts_unavailable.__test__ = False  # type: ignore[attr-defined]


def _enter_and_run(netns: str, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """In a fresh child process: join the host's network namespace, then run ``target``."""
    fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)
    return target(*args, **kwargs)


def _no_ipv6(link: str, prefix: list[str]) -> None:
    """IPv4 only on a test link: no IPv6 link-local address, so no router solicitations or neighbour discovery."""
    _run([*prefix, "sh", "-c", f"echo 1 > /proc/sys/net/ipv6/conf/{link}/disable_ipv6"])


class TestHost:
    """One host: a network namespace with ``lo`` and ``eth0`` at :attr:`address`."""

    __test__ = False

    def __init__(self, network: TestNetwork, name: str, address: str, holder: subprocess.Popen[bytes], bridge_port: str) -> None:
        self.network = network
        self.name = name
        self.address = address
        self.bridge_port = bridge_port  # the veth end on the bridge, in the suite's namespace
        self._holder = holder

    def __repr__(self) -> str:
        return f"TestHost({self.name!r}, {self.address})"

    @property
    def netns(self) -> str:
        """Path of this host's network namespace (``/proc/PID/ns/net`` of the process holding it)."""
        return f"/proc/{self._holder.pid}/ns/net"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host."""
        return ["nsenter", f"--net={self.netns}", "--", *argv]

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host and wait for it (output captured as text)."""
        done = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, list(argv), done.stdout, done.stderr)
        return done

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a command inside this host; the network stops it (by pid) when it closes."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.command(argv), preexec_fn=_die_with_parent, **kwargs)
        self.network._processes.append(proc)
        return proc

    def serve(self, argv: Sequence[str], *, port: int, timeout: float = 30.0, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a server inside this host and wait until ``address:port`` accepts connections."""
        proc = self.popen(argv, **kwargs)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} on {self.name} exited with code {proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection((self.address, port), timeout=0.5):
                return proc
            time.sleep(0.05)
        raise RuntimeError(f"{argv[0]} on {self.name} did not accept connections on {self.address}:{port} within {timeout} s")

    def process(self, ctx: Any, target: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseProcess:
        """A ``multiprocessing`` process (of context ``ctx``, not started) that runs ``target`` inside this host.

        With :func:`omni_plugins.testing.processes.process_context` the child forks from a
        server that imported torch once; it joins the host's namespace before ``target``
        runs, so every socket it opens is the host's. The network terminates it when it closes.
        """
        proc = ctx.Process(target=_enter_and_run, args=(self.netns, target, args, kwargs), daemon=True)
        self.network._processes.append(proc)
        return proc

    def free_port(self) -> int:
        """A TCP port free on this host now."""
        out = self.run([sys.executable, "-c", "from omni_plugins.ports import free_port; print(free_port(''))"])
        return int(out.stdout.strip())


class TestNetwork:
    """``n`` test hosts on one bridge (a context manager); see the module docstring."""

    __test__ = False

    def __init__(self, n: int = 3, *, names: Sequence[str] | None = None) -> None:
        problem = confinement_problem()
        if problem is not None:
            raise TestHostsUnavailable(problem)
        if not 1 <= n <= 200:
            raise ValueError("a test network has 1 to 200 hosts")
        self.index = next(_networks) % 256
        self.tag = f"{_PREFIX}{os.getpid() % 1000}n{self.index}"  # unique in this namespace; <= 11 chars
        self.subnet = ipaddress.ip_network(f"198.18.{self.index}.0/24")
        assert self.subnet.subnet_of(TEST_RANGE)  # type: ignore[arg-type]
        self.gateway = str(self.subnet[254])  # the bridge's own address (the test process)
        self.bridge = f"{self.tag}br"
        self.hosts: list[TestHost] = []
        self._processes: list[Any] = []
        self._holders: list[subprocess.Popen[bytes]] = []
        self._impaired: set[str] = set()
        names = list(names) if names is not None else [chr(ord("a") + i) if i < 26 else f"h{i}" for i in range(n)]
        if len(names) != n:
            raise ValueError(f"{n} hosts but {len(names)} names")
        try:
            self._make_bridge()
            for i, name in enumerate(names):
                self.hosts.append(self._make_host(name, str(self.subnet[i + 1]), i))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TestNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> TestHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    # -- building ---------------------------------------------------------------
    def _make_bridge(self) -> None:
        _checked(["ip", "link", "add", self.bridge, "type", "bridge"])
        _checked(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        _no_ipv6(self.bridge, [])
        _checked(["ip", "link", "set", self.bridge, "up"])

    def _make_host(self, name: str, address: str, i: int) -> TestHost:
        holder = subprocess.Popen(
            ["unshare", "--net", "--", "sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        self._holders.append(holder)
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while True:  # unshare has made the namespace once /proc/PID/ns/net differs from ours
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{holder.pid}/ns/net") != own:
                    break
            if holder.poll() is not None:
                err = holder.stderr.read().decode(errors="replace").strip() if holder.stderr else ""
                raise TestHostsUnavailable(f"`unshare --net` failed: {err or f'exit code {holder.returncode}'}")
            if time.monotonic() > deadline:
                raise TestHostsUnavailable("`unshare --net` did not make a namespace within 10 s")
            time.sleep(0.005)
        port, inner = f"{self.tag}p{i}", f"{self.tag}h{i}"
        _checked(["ip", "link", "add", port, "type", "veth", "peer", "name", inner])
        _checked(["ip", "link", "set", inner, "netns", str(holder.pid)])
        _checked(["ip", "link", "set", port, "master", self.bridge])
        _checked(["ip", "link", "set", port, "up"])
        host = TestHost(self, name, address, holder, port)
        _checked(host.command(["ip", "link", "set", inner, "name", "eth0"]))
        _no_ipv6("eth0", host.command([]))
        for argv in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
            ["ip", "link", "set", "eth0", "up"],
        ):
            _checked(host.command(argv))
        return host

    # -- faults -------------------------------------------------------------------
    def impair(self, hosts: Sequence[TestHost] | None = None, *, loss: float = 0.0, delay: float = 0.0) -> None:
        """``tc netem`` on each host's ``eth0`` egress: drop ``loss`` (a fraction) of packets, delay each by ``delay`` s.

        Applied on every host (the default), both directions of every link see it. Raises
        :class:`TestHostsUnavailable` when the kernel has no ``sch_netem`` (tests skip with it).
        """
        netem = ["netem"]
        if delay:
            netem += ["delay", f"{delay * 1000:g}ms"]
        if loss:
            netem += ["loss", f"{loss * 100:g}%"]
        for host in hosts if hosts is not None else self.hosts:
            done = _run(host.command(["tc", "qdisc", "replace", "dev", "eth0", "root", *netem]))
            if done.returncode != 0:
                err = (done.stderr or done.stdout).strip()
                if "unknown" in err.lower():
                    err = f"the kernel has no netem queueing discipline (sch_netem; CONFIG_NET_SCH_NETEM): {err}"
                raise TestHostsUnavailable(f"tc netem on {host.name}: {err}")
            self._impaired.add(host.name)

    def clear_impairments(self) -> None:
        for host in self.hosts:
            if host.name in self._impaired:
                _run(host.command(["tc", "qdisc", "del", "dev", "eth0", "root"]))
        self._impaired.clear()

    def netem_unavailable(self) -> str | None:
        """Why :meth:`impair` cannot work here, or None (tried on the first host, then undone)."""
        try:
            self.impair(self.hosts[:1], delay=0.001)
        except TestHostsUnavailable as exc:
            return str(exc)
        self.clear_impairments()
        return None

    def cut(self, host: TestHost) -> None:
        """Take ``host``'s bridge port down: packets to and from it are dropped silently (no reset, no error)."""
        _checked(["ip", "link", "set", host.bridge_port, "down"])

    def heal(self, host: TestHost) -> None:
        _checked(["ip", "link", "set", host.bridge_port, "up"])

    @contextlib.contextmanager
    def isolate(self, host: TestHost) -> Iterator[TestHost]:
        """A partition of ``host`` from every other host (and the test process) for the ``with`` block."""
        self.cut(host)
        try:
            yield host
        finally:
            self.heal(host)

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process started in the hosts, then the hosts; the links go with their namespaces."""
        for proc in reversed(self._processes):
            _stop(proc)
        self._processes.clear()
        for holder in self._holders:
            _stop(holder)
            if holder.stderr is not None:
                holder.stderr.close()
        self._holders.clear()
        if self.bridge in psutil.net_if_addrs():
            _run(["ip", "link", "del", self.bridge])
        for port in [name for name in _own_links() if name.startswith(self.tag)]:
            _run(["ip", "link", "del", port])  # a veth whose namespace is gone goes by itself; this is a safety net

    def leftovers(self) -> list[str]:
        """Links of this network still present (empty after :meth:`close`)."""
        return sorted(name for name in _own_links() if name.startswith(self.tag))


def _stop(proc: Any, timeout: float = 5.0) -> None:
    """Terminate a ``Popen`` or ``multiprocessing`` process by pid and wait for it (SIGKILL after ``timeout``)."""
    alive = proc.poll() is None if isinstance(proc, subprocess.Popen) else proc.pid is not None and proc.is_alive()
    if alive:
        proc.terminate()
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    elif proc.pid is not None:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout)
