"""The control channel: "where is key K" and "release K", as length-prefixed msgpack over TCP.

Frame: 4-byte big-endian length, then a msgpack map (at most 64 KiB). Requests::

    {"op": "claim",   "key": K}            -> {"ok": true, "found": false}
                                            | {"ok": true, "found": true, "segment": S, "addr": A, "size": N, "token": T}
    {"op": "finish",  "token": T}          -> {"ok": true, "released": bool}   (false: the claim had lapsed)
    {"op": "finish",  "token": T, "noreply": true}   (one-way: the reader knows its claim was live)
    {"op": "unclaim", "token": T}          -> {"ok": true}
    {"op": "discard", "key": K}            -> {"ok": true, "released": bool}
    {"op": "ping"}                         -> {"ok": true, "segment": S}

Any failure is ``{"ok": false, "error": "..."}``. Every socket operation has a
timeout, so a dead peer is an error after at most ``timeout`` seconds, never a
hang. No pickle: bytes from the network are untrusted and only msgpack-decoded
with small limits.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from omni_plugins.errors import ConnectorError
from omni_plugins_mooncake.config import parse_host_port

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_FRAME = 64 * 1024
PROTOCOL_VERSION = 1

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ProtocolError(ConnectorError):
    """A peer sent something that is not a valid control frame."""


class PeerUnreachableError(ConnectorError):
    """A peer's control channel could not be reached or stopped answering."""

    def __init__(self, address: str, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.address = address
        self.refused = refused


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"control message of {len(body)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > MAX_FRAME:
        raise ProtocolError(f"control frame of {length} bytes exceeds {MAX_FRAME}")
    body = _recv_exact(sock, length)
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, max_array_len=64, max_map_len=64, max_ext_len=0)
    except Exception as exc:
        raise ProtocolError(f"control frame is not valid msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("control frame is not a map")
    return message


class ControlServer:
    """A tiny threaded TCP server: one daemon thread accepts, one per connection answers."""

    def __init__(self, address: str, handler: Handler, *, idle_timeout: float = 120.0, name: str = "control") -> None:
        host, _, port = address.rpartition(":")
        self._handler = handler
        self._idle_timeout = idle_timeout
        self._name = name
        self._listener = socket.create_server((host.strip("[]"), int(port)), backlog=64)
        self._listener.settimeout(0.25)  # lets the accept loop notice close()
        bound_host, bound_port = self._listener.getsockname()[:2]
        self.address = f"{bound_host}:{bound_port}"
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        self._stopping.set()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(5)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self._idle_timeout)  # bounds both waiting for a request and sending a reply
            while not self._stopping.is_set():
                try:
                    request = recv_frame(conn)
                except (OSError, ConnectionError):
                    return
                except ProtocolError as exc:
                    logger.warning("%s %s: dropping a client that sent a bad frame: %s", self._name, self.address, exc)
                    return
                try:
                    reply = self._handler(request)
                except Exception as exc:  # a handler bug must not kill the channel silently
                    logger.exception("%s %s: request %r failed", self._name, self.address, request.get("op"))
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                if request.get("noreply") is True:
                    continue
                try:
                    send_frame(conn, reply)
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class ControlClient:
    """Requests to one peer over reused connections (one per concurrent caller)."""

    def __init__(self, address: str, *, timeout: float, max_idle_age: float = 30.0) -> None:
        self.address = address
        self._host, self._port = parse_host_port(address, what="peer address")
        self._timeout = timeout
        self._max_idle_age = max_idle_age
        self._idle: list[tuple[socket.socket, float]] = []
        self._lock = threading.Lock()

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the reply map; raise :class:`PeerUnreachableError` on any I/O failure."""
        message = {"v": PROTOCOL_VERSION, **message}
        sock, reused = self._checkout()
        try:
            reply = self._roundtrip(sock, message)
        except (OSError, ConnectionError) as exc:
            sock.close()
            if not reused:
                raise self._unreachable(exc) from exc
            sock = self._connect()  # the server may have closed an idle connection: retry once
            try:
                reply = self._roundtrip(sock, message)
            except (OSError, ConnectionError) as exc2:
                sock.close()
                raise self._unreachable(exc2) from exc2
        except ProtocolError:
            sock.close()
            raise
        self._checkin(sock)
        if reply.get("ok") is not True:
            raise ConnectorError(f"mooncake-te peer {self.address} refused {message.get('op')!r}: {reply.get('error', reply)}")
        return reply

    def notify(self, message: dict[str, Any]) -> None:
        """Send a one-way request (``noreply``); raise :class:`PeerUnreachableError` if it cannot be sent."""
        message = {"v": PROTOCOL_VERSION, **message, "noreply": True}
        sock, reused = self._checkout()
        try:
            send_frame(sock, message)
        except (OSError, ConnectionError) as exc:
            sock.close()
            if not reused:
                raise self._unreachable(exc) from exc
            sock = self._connect()
            try:
                send_frame(sock, message)
            except (OSError, ConnectionError) as exc2:
                sock.close()
                raise self._unreachable(exc2) from exc2
        self._checkin(sock)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def _roundtrip(self, sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
        send_frame(sock, message)  # the socket carries `timeout` from create_connection
        return recv_frame(sock)

    def _checkout(self) -> tuple[socket.socket, bool]:
        now = time.monotonic()
        stale: list[socket.socket] = []
        found: socket.socket | None = None
        with self._lock:
            while self._idle:
                sock, since = self._idle.pop()
                if now - since < self._max_idle_age:
                    found = sock
                    break
                stale.append(sock)
        for sock in stale:
            sock.close()
        if found is not None:
            return found, True
        return self._connect(), False

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append((sock, time.monotonic()))

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
        except OSError as exc:
            raise self._unreachable(exc) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _unreachable(self, exc: BaseException) -> PeerUnreachableError:
        return PeerUnreachableError(
            self.address,
            f"mooncake-te peer {self.address} is unreachable ({type(exc).__name__}: {exc})",
            refused=isinstance(exc, ConnectionRefusedError),
        )
