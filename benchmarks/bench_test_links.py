"""Benchmark the test network's links: the userspace TUN forwarder against a kernel veth pair, in the same run.

Two test hosts (``omni_plugins.testing.netns.TestNetwork``): a client process in host a, a sink
process in host b. One sample is one hand-off over a kept TCP connection: the client sends an
8-byte length and the payload, the sink reads all of it and answers one byte, and the client
times the whole exchange. Paths, interleaved round by round so drift hits all alike:

- ``veth``: a veth pair straight between the two hosts' namespaces: the kernel alone, the baseline
- ``forwarder``: the hosts' ``eth0``, through the forwarder, at the network's default MTU (64 KiB)
- ``forwarder_mtu1500``: the same on a second network made with ``mtu=1500``
- ``forwarder_impaired`` (context): ``forwarder`` under what the tests apply, 5 % loss and
  20 ms delay on every host's egress (seeded), so the cost of an impaired hand-off is known

Per size and path: the median hand-off in ms and the throughput it gives; for the forwarder
paths also the forwarder's CPU seconds per GiB carried. Ratios: each path's throughput over
``veth``'s, measured in the same run.

It needs what the tests need: it runs itself in a new user and network namespace (``unshare
--user --map-root-user --net``), so it touches no real network, and makes its hosts there.

    python benchmarks/bench_test_links.py [--quick] [--sizes 64KiB,1MiB,16MiB] [--rounds N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

import psutil
from tqdm import tqdm

from omni_plugins.bench.runner import machine
from omni_plugins.bench.schema import BenchDocument, Column, Section
from omni_plugins.bench.units import format_size, parse_size
from omni_plugins.testing.netns import TestHost, TestNetwork, test_hosts_unavailable

SIZES = "64KiB,1MiB,16MiB"
PORT = 9100
VETH = ("198.19.255.1", "198.19.255.2")  # the baseline pair's addresses: the benchmarking range, as every test link
IMPAIRMENT = {"loss": 0.05, "delay": 0.02, "seed": 1}
ABOUT = (
    "One hand-off between two test hosts over a kept TCP connection (length, payload, one-byte answer), "
    "timed by the client; per size and path the median and the throughput it gives, vs veth = that "
    "throughput over the kernel veth pair's in the same run; forwarder CPU per GiB carried."
)
COLUMNS = [
    Column(key="size", label="size", kind="size"),
    Column(key="path", label="path", kind="text"),
    Column(key="p50_ms", label="p50 ms", digits=3),
    Column(key="mib_per_s", label="MiB/s", digits=0),
    Column(key="vs_veth", label="vs veth"),
    Column(key="forwarder_cpu_s_per_gib", label="forwarder CPU s/GiB"),
]

SINK = """
import socket, sys, threading
def serve(conn):
    buf = bytearray(1 << 20)
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            left = int.from_bytes(head, "little")
            while left:
                n = conn.recv_into(buf, min(left, len(buf)))
                if not n:
                    return
                left -= n
            conn.sendall(b"k")
listener = socket.create_server(("", int(sys.argv[1])))
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],), daemon=True).start()
"""

CLIENT = """
import json, socket, sys, time
conns, payloads = {}, {}
for line in sys.stdin:
    path, address, size, count = json.loads(line)
    if path not in conns:
        conns[path] = socket.create_connection((address, int(sys.argv[1])), timeout=120)
        conns[path].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s, payload = conns[path], payloads.setdefault(size, memoryview(bytearray(b"x" * size)))
    times = []
    for _ in range(count):
        started = time.perf_counter()
        s.sendall(size.to_bytes(8, "little"))
        s.sendall(payload)
        if s.recv(1) != b"k":
            raise SystemExit("the sink closed the connection")
        times.append(time.perf_counter() - started)
    print(json.dumps(times), flush=True)
"""


def _confine() -> None:
    """Re-run this script in a new user and network namespace, unless it already runs in one."""
    if os.environ.get("OMNI_TEST_NETNS") == "confined":
        return
    if shutil.which("unshare") is None:
        raise SystemExit("needs unshare (util-linux)")
    script = 'ip link set lo up && OMNI_TEST_NETNS=confined exec "$@"'
    os.execvp("unshare", ["unshare", "--user", "--map-root-user", "--net", "sh", "-c", script, "sh", sys.executable, *sys.argv])


class Path:
    """A client in one host sending to an address in another, over one kept connection."""

    def __init__(self, name: str, client: subprocess.Popen[str], address: str, net: TestNetwork | None) -> None:
        self.name, self.client, self.address, self.net = name, client, address, net
        self.samples: dict[int, list[float]] = {}
        self.cpu: dict[int, float] = {}  # size -> forwarder CPU seconds spent on this path's samples

    def run(self, size: int, count: int) -> None:
        forwarder = psutil.Process(self.net.forwarder_pid) if self.net is not None and self.net.forwarder_pid else None
        cpu = sum(forwarder.cpu_times()[:2]) if forwarder else 0.0
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(json.dumps([self.name, self.address, size, count]) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the client exited")
        self.samples.setdefault(size, []).extend(json.loads(line))
        if forwarder:
            self.cpu[size] = self.cpu.get(size, 0.0) + sum(forwarder.cpu_times()[:2]) - cpu


def _client(host: TestHost) -> subprocess.Popen[str]:
    return host.popen([sys.executable, "-c", CLIENT, str(PORT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _sink(host: TestHost) -> None:
    sink = host.popen([sys.executable, "-c", SINK, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None and sink.stdout.readline() == "ready\n"


def _veth(net: TestNetwork, a: TestHost, b: TestHost) -> None:
    """A veth pair between hosts a and b with the :data:`VETH` addresses."""
    ends = (f"{net.tag}va", f"{net.tag}vb")
    subprocess.run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]], check=True)
    for end, host, address in zip(ends, (a, b), VETH, strict=True):
        subprocess.run(["ip", "link", "set", end, "netns", str(host._holder.pid)], check=True)
        host.run(["ip", "addr", "add", f"{address}/30", "dev", end])
        host.run(["ip", "link", "set", end, "up"])


def _count(size: int) -> int:
    """Hand-offs per sample: enough bytes that a sample is not one system call's noise."""
    return max(2, min(40, (8 << 20) // size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--sizes", default=SIZES, help=f"comma-separated payload sizes (default {SIZES})")
    parser.add_argument("--rounds", type=int, help="samples per size and path (default 15)")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    args = parser.parse_args()
    _confine()
    reason = test_hosts_unavailable()
    if reason:
        raise SystemExit(f"no test hosts here: {reason}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rounds = args.rounds or (5 if args.quick else 15)
    with TestNetwork(2) as net, TestNetwork(2, mtu=1500) as narrow:
        a, b = net.hosts
        _veth(net, a, b)
        _sink(b)
        _sink(narrow.hosts[1])
        client, narrow_client = _client(a), _client(narrow.hosts[0])
        paths = [
            Path("veth", client, VETH[1], None),
            Path("forwarder", client, b.address, net),
            Path("forwarder_mtu1500", narrow_client, narrow.hosts[1].address, narrow),
            Path("forwarder_impaired", client, b.address, net),
        ]
        with tqdm(total=len(sizes) * rounds * len(paths), desc="hand-offs", unit="sample") as bar:
            for size in sizes:
                for path in paths:
                    path.run(size, 1)  # warm-up: connection, slow start
                for r in range(rounds):
                    for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
                        if path.name == "forwarder_impaired":
                            net.impair(**IMPAIRMENT)  # type: ignore[arg-type]
                        path.run(size, _count(size) if path.name != "forwarder_impaired" else 2)
                        net.clear_impairments()
                        bar.update()
    rows: list[dict[str, Any]] = []
    for size in sizes:
        veth = size / statistics.median(paths[0].samples[size])
        for path in paths:
            p50 = statistics.median(path.samples[size])
            row: dict[str, Any] = {"size": size, "path": path.name, "p50_ms": p50 * 1e3, "mib_per_s": size / p50 / (1 << 20)}
            row["vs_veth"] = (size / p50) / veth
            if size in path.cpu:
                row["forwarder_cpu_s_per_gib"] = path.cpu[size] / (len(path.samples[size]) * size / (1 << 30))
            rows.append(row)
    doc = BenchDocument(
        command="python benchmarks/bench_test_links.py" + (" --quick" if args.quick else "") + f" --sizes {args.sizes}",
        final=not args.quick,
        machine=machine(),
    )
    doc.sections["links"] = Section(title="Test-host links", about=ABOUT, columns=COLUMNS, rows=rows)
    doc.machine.load_avg_end = [round(x, 2) for x in os.getloadavg()]
    for row in rows:
        print(
            f"{format_size(row['size'])} {row['path']}: {row['p50_ms']:.2f} ms ({row['mib_per_s']:.0f} MiB/s, {row['vs_veth']:.2f}x veth)"
        )
    if args.json_path:
        doc.write(args.json_path)


if __name__ == "__main__":
    main()
