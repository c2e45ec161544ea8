"""The test network's forwarder on its own: datagram socket pairs stand in for TUN devices (no namespaces needed)."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from omni_plugins.testing.tun_forwarder import Forwarder, Link

ADDRESSES = ["198.18.250.1", "198.18.250.2", "198.18.250.254"]


def packet(dst: str, body: bytes, src: str = "198.18.250.9") -> bytes:
    """A bare IPv4 header (the forwarder reads the version and the destination) and ``body``."""
    header = bytes([0x45, 0]) + (20 + len(body)).to_bytes(2, "big") + bytes(8)
    return header + ipaddress.IPv4Address(src).packed + ipaddress.IPv4Address(dst).packed + body


class Running:
    """A forwarder over socket pairs in a thread; ``ends[i]`` is the host side of link ``i``."""

    def __init__(self) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in ADDRESSES]
        self.ends = [host for host, _ in pairs]
        self._theirs = [link for _, link in pairs]
        for end in self.ends:
            end.settimeout(5)
        links = [Link(s.fileno(), ipaddress.IPv4Address(a).packed) for s, a in zip(self._theirs, ADDRESSES, strict=True)]
        control_r, self._control = os.pipe()
        replies_r, replies_w = os.pipe()
        self._replies = os.fdopen(replies_r, "rb")
        self._control_r, replies = control_r, os.fdopen(replies_w, "w")
        self.thread = threading.Thread(target=Forwarder(links, control_r, replies).run, daemon=True)
        self.thread.start()

    def call(self, **command: Any) -> dict[str, Any]:
        os.write(self._control, json.dumps(command).encode() + b"\n")
        reply: dict[str, Any] = json.loads(self._replies.readline())
        return reply

    def stats(self, i: int) -> dict[str, int]:
        return dict(self.call(op="stats")["stats"][ADDRESSES[i]])

    def close(self) -> None:
        os.close(self._control)  # end of input ends the loop
        self.thread.join(10)
        for s in self.ends + self._theirs:
            s.close()
        self._replies.close()
        os.close(self._control_r)


@pytest.fixture
def fwd() -> Iterator[Running]:
    running = Running()
    yield running
    running.close()
    assert not running.thread.is_alive()


def test_routes_by_destination_and_drops_what_goes_nowhere(fwd: Running) -> None:
    fwd.ends[0].send(packet(ADDRESSES[1], b"to b"))
    fwd.ends[0].send(packet(ADDRESSES[2], b"to the test process"))
    assert fwd.ends[1].recv(100).endswith(b"to b")
    assert fwd.ends[2].recv(100).endswith(b"to the test process")
    fwd.ends[0].send(packet("198.18.250.99", b"nobody"))
    fwd.ends[0].send(bytes([0x60]) + bytes(39))  # IPv6
    fwd.ends[0].send(b"short")
    fwd.ends[0].send(packet(ADDRESSES[0], b"to itself"))  # a host's own address never crosses its link
    assert fwd.stats(0) == {"sent": 2, "delivered": 0, "lost": 0, "partitioned": 0, "unroutable": 4, "failed": 0}
    assert fwd.stats(1)["delivered"] == 1


def test_seeded_loss_drops_a_repeatable_share(fwd: Running) -> None:
    assert fwd.call(op="impair", address=ADDRESSES[0], loss=0.3, delay=0.0, seed="s") == {"ok": True}
    for i in range(200):
        fwd.ends[0].send(packet(ADDRESSES[1], str(i).encode()))
    lost = fwd.stats(0)["lost"]
    got = [int(fwd.ends[1].recv(100)[20:]) for _ in range(200 - lost)]
    rng = random.Random("s")
    assert got == [i for i in range(200) if rng.random() >= 0.3]  # exactly the seeded draws, in order


def test_delay_holds_packets_and_keeps_their_order(fwd: Running) -> None:
    fwd.call(op="impair", address=ADDRESSES[0], loss=0.0, delay=0.2)
    started = time.monotonic()
    for i in range(20):
        fwd.ends[0].send(packet(ADDRESSES[1], str(i).encode()))
    got = [int(fwd.ends[1].recv(100)[20:]) for _ in range(20)]
    assert time.monotonic() - started >= 0.2  # a lower bound: nothing is delivered early
    assert got == list(range(20))
    fwd.ends[1].send(packet(ADDRESSES[0], b"back"))  # the other direction is not delayed by a's egress
    assert fwd.ends[0].recv(100).endswith(b"back")


def test_a_cut_drops_both_directions_and_what_is_on_its_way(fwd: Running) -> None:
    fwd.call(op="impair", address=ADDRESSES[0], delay=0.2)
    fwd.ends[0].send(packet(ADDRESSES[1], b"held"))
    fwd.call(op="partition", address=ADDRESSES[1], cut=True)
    fwd.ends[1].send(packet(ADDRESSES[0], b"from the cut host"))
    fwd.ends[0].send(packet(ADDRESSES[1], b"to the cut host"))
    deadline = time.monotonic() + 10
    while fwd.stats(0)["partitioned"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the held packet is dropped when due
    fwd.call(op="partition", address=ADDRESSES[1], cut=False)
    fwd.call(op="impair", address=ADDRESSES[0])
    fwd.ends[0].send(packet(ADDRESSES[1], b"after the heal"))
    assert fwd.ends[1].recv(100).endswith(b"after the heal")
    assert fwd.stats(0)["partitioned"] == 2 and fwd.stats(1)["partitioned"] == 1


def test_bad_commands_are_refused_and_the_links_keep_running(fwd: Running) -> None:
    assert "error" in fwd.call(op="impair", address=ADDRESSES[0], loss=1.5)
    assert "error" in fwd.call(op="impair", address="10.0.0.1")
    assert "error" in fwd.call(op="reboot", address=ADDRESSES[0])
    fwd.ends[0].send(packet(ADDRESSES[1], b"still here"))
    assert fwd.ends[1].recv(100).endswith(b"still here")
