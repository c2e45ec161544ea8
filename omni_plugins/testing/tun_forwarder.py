"""The links of a test network: one process forwarding IP packets between TUN devices, with faults.

Each host of a :class:`~omni_plugins.testing.netns.TestNetwork` has a TUN device
as its ``eth0`` (layer 3: no Ethernet header, no ARP), and the test process has
one more, the gateway. The network opens them all and hands their file
descriptors to this process, which reads every packet the hosts send, looks up
the link that owns the destination address and writes the packet there. On the
way it applies what the test asked for, per link and per direction (on the
sending link's egress): random loss (a seeded random draw per packet), a fixed
delay (packets wait in a queue ordered by due time, so order is kept), and
partitions (every packet to or from a cut link is dropped, at sending and again
at delivery). Only IPv4 packets to an address of one of its links are ever
written anywhere; everything else is counted and dropped.

Why userspace and not ``tc netem``: netem is a kernel module many kernels do not
have or cannot load in a container, while TUN devices are nearly always built
in, and a TUN device can be created by the (user-namespace) root of the test
suite's own namespace and then moved into a host's namespace, its descriptor
staying with this process. With the large MTU the network sets (64 KiB), a
1 MiB payload is some 20 packets, so a plain ``selectors`` loop keeps up.

It runs as a script (standard library only, so it starts in tens of
milliseconds): ``python tun_forwarder.py SPEC_JSON`` with the descriptors
inherited. Commands arrive as JSON lines on stdin, one JSON reply line each on
stdout; end of input (the network closed it, or its process died) ends it, and
so does ``SIGKILL`` on the parent's death, which the network arranges.

Commands (``address`` is a link's IPv4 address as a string):

- ``{"op": "impair", "address": A, "loss": 0.05, "delay": 0.02, "seed": 1}``: egress of link A
- ``{"op": "partition", "address": A, "cut": true}``: drop everything to or from A (``false`` heals)
- ``{"op": "stats"}``: ``{"stats": {A: {counter: n}}}``; counters: ``sent`` (packets read from
  the link), ``delivered`` (written to it), ``lost`` (random drops of its egress),
  ``partitioned`` (dropped by a cut on either end), ``unroutable`` (not IPv4, or to no link),
  ``failed`` (the write to the destination failed, e.g. its namespace is gone)
"""

from __future__ import annotations

import fcntl
import heapq
import ipaddress
import itertools
import json
import os
import random
import selectors
import signal
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
MAX_PACKET = 65535  # an IPv4 packet's largest total length; also a TUN device's largest MTU
_BURST = 64  # packets read from one link per wake-up before the others get their turn
COUNTERS = ("sent", "delivered", "lost", "partitioned", "unroutable", "failed")


def open_tun(name: str) -> int:
    """Create TUN device ``name`` (layer 3, no packet-info header) in this process's network namespace.

    The device exists as long as the returned descriptor (or a copy of it) is open,
    wherever the device has been moved since.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Link:
    """One TUN device: its address, the faults on its egress, whether it is cut off, its counters."""

    fd: int
    address: bytes  # 4 bytes, as in an IPv4 header
    loss: float = 0.0
    delay: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    cut: bool = False
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))


class Forwarder:
    """The forwarding loop over ``links``, controlled through the ``control`` descriptor (JSON lines)."""

    def __init__(self, links: list[Link], control: int, replies: Any) -> None:
        self.links = {link.address: link for link in links}
        self.control, self.replies = control, replies
        self.queue: list[tuple[float, int, Link, Link, bytes]] = []  # (due, order, source, destination, packet)
        self.order = itertools.count()
        self.selector = selectors.DefaultSelector()
        self.pending = b""

    def run(self) -> None:
        for link in self.links.values():
            os.set_blocking(link.fd, False)
            self.selector.register(link.fd, selectors.EVENT_READ, link)
        self.selector.register(self.control, selectors.EVENT_READ, None)
        while True:
            timeout = max(0.0, self.queue[0][0] - time.monotonic()) if self.queue else None
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    if not self._control():
                        return
                else:
                    self._read(key.data)
            now = time.monotonic()
            while self.queue and self.queue[0][0] <= now:
                _, _, source, destination, packet = heapq.heappop(self.queue)
                self._deliver(source, destination, packet)

    def _read(self, link: Link) -> None:
        for _ in range(_BURST):
            try:
                packet = os.read(link.fd, MAX_PACKET)
            except BlockingIOError:
                return
            except OSError:  # the device is gone with its namespace: nothing more will come from it
                self.selector.unregister(link.fd)
                return
            self._route(link, packet)

    def _route(self, source: Link, packet: bytes) -> None:
        destination = self.links.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
        if destination is None or destination is source:
            source.counts["unroutable"] += 1
            return
        source.counts["sent"] += 1
        if source.cut or destination.cut:
            source.counts["partitioned"] += 1
        elif source.loss and source.rng.random() < source.loss:
            source.counts["lost"] += 1
        elif source.delay:
            heapq.heappush(self.queue, (time.monotonic() + source.delay, next(self.order), source, destination, packet))
        else:
            self._deliver(source, destination, packet)

    def _deliver(self, source: Link, destination: Link, packet: bytes) -> None:
        if source.cut or destination.cut:  # cut while the packet was on its way
            source.counts["partitioned"] += 1
            return
        try:
            os.write(destination.fd, packet)
        except OSError:
            destination.counts["failed"] += 1
            return
        destination.counts["delivered"] += 1

    def _control(self) -> bool:
        """Handle the complete command lines that arrived; False at end of input."""
        data = os.read(self.control, 65536)
        if not data:
            return False
        self.pending += data
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            try:
                reply = self._command(json.loads(line))
            except Exception as exc:  # a bad command is the caller's error, reported to it; the links keep running
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            self.replies.write(json.dumps(reply) + "\n")
            self.replies.flush()
        return True

    def _command(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "stats":
            return {"stats": {str(ipaddress.IPv4Address(a)): dict(link.counts) for a, link in self.links.items()}}
        link = self.links[ipaddress.IPv4Address(command["address"]).packed]
        if op == "impair":
            loss, delay = float(command.get("loss", 0.0)), float(command.get("delay", 0.0))
            if not 0.0 <= loss <= 1.0 or delay < 0.0:
                raise ValueError(f"loss must be in [0, 1] and delay >= 0, not loss={loss}, delay={delay}")
            link.loss, link.delay, link.rng = loss, delay, random.Random(command.get("seed"))
        elif op == "partition":
            link.cut = bool(command["cut"])
        else:
            raise ValueError(f"unknown op {op!r}")
        return {"ok": True}


def main(argv: list[str]) -> None:
    """``argv[0]``: JSON list of ``{"fd": N, "address": "198.18.x.y"}``, one per inherited TUN descriptor."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the test run; it closes the network, which ends this
    links = [Link(int(spec["fd"]), ipaddress.IPv4Address(spec["address"]).packed) for spec in json.loads(argv[0])]
    Forwarder(links, sys.stdin.fileno(), sys.stdout).run()


if __name__ == "__main__":
    main(sys.argv[1:])
