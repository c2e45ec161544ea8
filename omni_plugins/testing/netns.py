"""Test hosts: child network namespaces joined by impairable links, for multi-host tests on one machine.

A :class:`TestNetwork` makes ``n`` hosts, each its own network namespace with
``lo`` and one ``eth0``, addressed from the benchmarking range 198.18.0.0/15.
Every ``eth0`` is a TUN device whose other end is one forwarding process
(:mod:`omni_plugins.testing.tun_forwarder`) that carries packets between the
hosts; the test process has a link of its own at the network's ``.254``
address, so it reaches every host too. Processes run inside a host
(:meth:`TestHost.popen`, :meth:`TestHost.run`, :meth:`TestHost.process` for a
Python target), links get packet loss and delay (:meth:`TestNetwork.impair`)
and hosts are cut off and healed (:meth:`TestNetwork.isolate`): the forwarder
does both, so they work on any kernel with TUN devices. Closing the network
stops every process it started, and the namespaces and links go with them.
Example::

    from omni_plugins.testing.netns import TestNetwork, test_hosts_unavailable

    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with TestNetwork(3) as net:
        a, b, c = net.hosts
        server = c.serve(["redis-server", "--bind", c.address, "--port", "7000", "--save", ""], port=7000)
        with net.isolate(c):          # c unreachable: packets to and from it are dropped silently
            ...
        net.impair(loss=0.05, delay=0.02)   # every host's egress: 5 % of packets lost, 20 ms delay

Safety: a network is only made inside the test suite's own network namespace
(``scripts/setup.sh test`` runs pytest in one whose only interface is ``lo`` and
says so with ``OMNI_TEST_NETNS=confined``), never in a machine's real one:
outside it every constructor raises :class:`TestHostsUnavailable` and
:func:`test_hosts_unavailable` gives the reason to skip with. Nothing sends to
any address but loopback and the network's own 198.18.x.0/24.

How it works without root on the machine: the suite's namespace belongs to a
user namespace where the test process is root, so it may create TUN devices
there and new network namespaces below it. A host's namespace is held by a
``sleep`` process started with ``unshare --net`` (no ``ip netns add``, which
would need a writable ``/run/netns`` mount); its TUN device is created in the
suite's namespace and moved into the host's (``ip link set DEV netns PID``)
while the forwarder keeps its descriptor. Commands enter a host with
``nsenter --net=/proc/PID/ns/net``, Python targets with ``setns(2)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from omni_plugins.testing import tun_forwarder
from omni_plugins.testing.tun_forwarder import MAX_PACKET, open_tun

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


def _run(argv: Sequence[str], *, input: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False)


def _checked(argv: Sequence[str], *, input: str | None = None, timeout: float = 30.0) -> str:
    done = _run(argv, input=input, timeout=timeout)
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
        missing = [tool for tool in ("ip", "unshare", "nsenter") if shutil.which(tool) is None]
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


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Held while a network picks its subnet and assigns its gateway address (a file lock: every process of the suite)."""
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"omni-plugins-test-networks-{os.getuid()}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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

    def __init__(self, network: TestNetwork, name: str, address: str, holder: subprocess.Popen[bytes]) -> None:
        self.network = network
        self.name = name
        self.address = address
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
    """``n`` test hosts on one network of impairable links (a context manager); see the module docstring.

    ``mtu`` is every link's MTU: the default, a TUN device's largest, keeps a 1 MiB
    payload to about 20 packets, so the forwarder is far from limiting a test and
    a loss rate costs TCP retransmissions, not its throughput collapse.
    """

    __test__ = False

    def __init__(self, n: int = 3, *, names: Sequence[str] | None = None, mtu: int = MAX_PACKET) -> None:
        problem = confinement_problem()
        if problem is not None:
            raise TestHostsUnavailable(problem)
        if not 1 <= n <= 200:
            raise ValueError("a test network has 1 to 200 hosts")
        if not 576 <= mtu <= MAX_PACKET:
            raise ValueError(f"mtu must be 576 to {MAX_PACKET}, not {mtu}")
        self.mtu = mtu
        self.tag: str | None = None  # the names of this network's links (set with its subnet)
        self.hosts: list[TestHost] = []
        self._processes: list[Any] = []
        self._holders: list[subprocess.Popen[bytes]] = []
        self._tuns: dict[int, str] = {}  # descriptor -> address, until the forwarder holds them
        self._forwarder: _Forwarder | None = None
        names = list(names) if names is not None else [chr(ord("a") + i) if i < 26 else f"h{i}" for i in range(n)]
        if len(names) != n:
            raise ValueError(f"{n} hosts but {len(names)} names")
        try:
            with _subnet_lock():  # another process of the suite (a pytest-xdist worker) may be making a network now
                self._claim_subnet()
                self._make_gateway()
            for i, name in enumerate(names):
                self.hosts.append(self._make_host(name, str(self.subnet[i + 1]), i))
            self._forwarder = _Forwarder(self._tuns)
        except BaseException:
            self.close()
            raise
        finally:
            for fd in self._tuns:  # the forwarder has its copies; a link lives as long as the forwarder
                os.close(fd)
            self._tuns.clear()

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
    def _claim_subnet(self) -> None:
        """A 198.18.x.0/24 no other network of this namespace uses: its gateway address is not assigned yet."""
        taken = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
        first = next(_networks)
        index = next((i % 256 for i in range(first, first + 256) if f"198.18.{i % 256}.254" not in taken), None)
        if index is None:
            raise TestHostsUnavailable("every 198.18.x.0/24 test network of this namespace is in use")
        self.index = index
        self.tag = f"{_PREFIX}{os.getpid() % 1000}n{self.index}"  # unique in this namespace; <= 11 chars
        self.subnet = ipaddress.ip_network(f"198.18.{self.index}.0/24")
        assert self.subnet.subnet_of(TEST_RANGE)  # type: ignore[arg-type]
        self.gateway = str(self.subnet[254])  # the test process's own address on the network
        self.gateway_link = f"{self.tag}gw"  # its TUN device, in the suite's namespace

    def _tun(self, link: str, address: str) -> None:
        try:
            fd = open_tun(link)
        except OSError as exc:
            raise TestHostsUnavailable(f"cannot create TUN device {link} (/dev/net/tun, CONFIG_TUN): {exc}") from exc
        self._tuns[fd] = address

    def _configure(self, link: str, address: str, prefix: list[str]) -> None:
        """IPv4 only, the MTU, the address and up, for ``link`` inside ``prefix`` (a host's command prefix, or none)."""
        _no_ipv6(link, prefix)
        batch = f"link set {link} mtu {self.mtu}\naddr add {address}/24 dev {link}\nlink set {link} up\n"
        _checked([*prefix, "ip", "-batch", "-"], input=batch)

    def _make_gateway(self) -> None:
        self._tun(self.gateway_link, self.gateway)
        self._configure(self.gateway_link, self.gateway, [])

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
        link = f"{self.tag}h{i}"
        self._tun(link, address)
        _checked(["ip", "link", "set", link, "netns", str(holder.pid)])
        host = TestHost(self, name, address, holder)
        _checked(host.command(["ip", "-batch", "-"]), input=f"link set lo up\nlink set {link} name eth0\n")
        self._configure("eth0", address, host.command([]))
        return host

    # -- faults -------------------------------------------------------------------
    def impair(self, hosts: Sequence[TestHost] | None = None, *, loss: float = 0.0, delay: float = 0.0, seed: int | None = None) -> None:
        """On each host's egress, drop ``loss`` (a fraction) of the packets at random and delay the rest by ``delay`` s.

        Applied on every host (the default), both directions of every link see it;
        packets the test process sends are not impaired. Delayed packets keep their
        order. ``seed`` makes each link's sequence of random drops repeatable.
        Replaces what was set before on those hosts; ``loss=0, delay=0`` clears it.
        """
        if not 0.0 <= loss <= 1.0 or delay < 0.0:
            raise ValueError(f"loss must be in [0, 1] and delay >= 0, not loss={loss}, delay={delay}")
        for host in hosts if hosts is not None else self.hosts:
            link_seed = None if seed is None else f"{seed}:{host.address}"
            self._control({"op": "impair", "address": host.address, "loss": loss, "delay": delay, "seed": link_seed})

    def clear_impairments(self) -> None:
        """No loss and no delay on any host."""
        self.impair(loss=0.0, delay=0.0)

    def cut(self, host: TestHost) -> None:
        """Drop every packet to and from ``host`` silently (no reset, no error), also those already on their way."""
        self._control({"op": "partition", "address": host.address, "cut": True})

    def heal(self, host: TestHost) -> None:
        self._control({"op": "partition", "address": host.address, "cut": False})

    @contextlib.contextmanager
    def isolate(self, host: TestHost) -> Iterator[TestHost]:
        """A partition of ``host`` from every other host (and the test process) for the ``with`` block."""
        self.cut(host)
        try:
            yield host
        finally:
            self.heal(host)

    @property
    def forwarder_pid(self) -> int | None:
        """The pid of the process that carries every packet of this network (None once closed)."""
        return self._forwarder.pid if self._forwarder is not None else None

    def link_stats(self) -> dict[str, dict[str, int]]:
        """Packet counters per link, by address (the hosts' and :attr:`gateway`), as the forwarder keeps them.

        ``sent``: packets the link's owner sent to another link; ``delivered``: written
        to it; ``lost``: its egress's random drops; ``partitioned``: dropped by a cut
        on either end; ``unroutable``: not IPv4 or to no link; ``failed``: the write
        to this link failed.
        """
        return dict(self._control({"op": "stats"})["stats"])

    def _control(self, command: dict[str, Any]) -> dict[str, Any]:
        if self._forwarder is None:
            raise RuntimeError("the test network is closed")
        return self._forwarder.call(command)

    # -- teardown -------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process started in the hosts, then the links and the hosts."""
        for proc in reversed(self._processes):
            _stop(proc)
        self._processes.clear()
        if self._forwarder is not None:
            self._forwarder.close()  # its descriptors were the last ones: every TUN device goes with them
            self._forwarder = None
        for holder in self._holders:
            _stop(holder)
            if holder.stderr is not None:
                holder.stderr.close()
        self._holders.clear()
        for link in self.leftovers():  # a safety net: a device exists only while a descriptor of it is open
            _run(["ip", "link", "del", link])

    def leftovers(self) -> list[str]:
        """Links of this network still present in the suite's namespace (empty after :meth:`close`)."""
        tag = self.tag
        return [] if tag is None else sorted(name for name in _own_links() if name.startswith(tag))


class _Forwarder:
    """The forwarding process (:mod:`omni_plugins.testing.tun_forwarder`) over the network's TUN descriptors."""

    def __init__(self, tuns: dict[int, str], timeout: float = 10.0) -> None:
        spec = json.dumps([{"fd": fd, "address": address} for fd, address in tuns.items()])
        self._proc = subprocess.Popen(
            [sys.executable, "-I", tun_forwarder.__file__, spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            pass_fds=list(tuns),
            preexec_fn=_die_with_parent,
        )
        self._timeout = timeout
        self._lock = threading.Lock()  # one command and its reply at a time
        self._replies = b""
        try:
            self.call({"op": "stats"})  # answered once the forwarding loop runs
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            try:
                self._proc.stdin.write(json.dumps(command).encode() + b"\n")  # type: ignore[union-attr]
            except BrokenPipeError:
                raise TestHostsUnavailable(self._exited()) from None
            reply: dict[str, Any] = json.loads(self._reply_line())
        if "error" in reply:
            raise RuntimeError(f"the test network's forwarder refused {command}: {reply['error']}")
        return reply

    def _reply_line(self) -> bytes:
        out = self._proc.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()  # not select(): a busy test process may hold descriptors above 1024
        poller.register(out, select.POLLIN)
        deadline = time.monotonic() + self._timeout
        while b"\n" not in self._replies:
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                raise TestHostsUnavailable(f"the test network's forwarder did not answer within {self._timeout} s")
            data = os.read(out, 65536)
            if not data:
                raise TestHostsUnavailable(self._exited())
            self._replies += data
        line, self._replies = self._replies.split(b"\n", 1)
        return line

    def _exited(self) -> str:
        self._proc.wait(5)
        err = self._proc.stderr.read().decode(errors="replace").strip() if self._proc.stderr else ""  # type: ignore[union-attr]
        return f"the test network's forwarder exited with code {self._proc.returncode}: {err}"

    def close(self) -> None:
        """End of input ends the forwarder; it is killed if it does not exit by itself."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()  # type: ignore[union-attr]
        _stop(self._proc)
        for pipe in (self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                pipe.close()


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
