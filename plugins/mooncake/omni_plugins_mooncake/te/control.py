"""The control channel: "where is key K" and "release K", as length-prefixed msgpack over authenticated TCP.

Frame: 4-byte big-endian length, then a body (at most 64 KiB).

Every connection starts with a handshake that proves, both ways, knowledge of a
shared secret (HMAC-SHA256 over two fresh nonces; the secret itself never
crosses the wire; the core's :class:`omni_plugins.channel.SecretHandshake`
under the protocol name ``omni-plugins mooncake-te control v2``). The server
sends nothing but the challenge and its verdict, and serves nothing, before a
valid proof; a bad one gets a refusal and the connection is closed::

    server -> 0x10 version:u8 server_nonce(32)                      (challenge, on accept)
    client -> 0x11 client_nonce(32) HMAC(secret, "client" | Ns | Nc)  (proof)
    server -> 0x12 HMAC(secret, "server" | Ns | Nc)                  (accepted: the client checks it)
            | 0x13 reason(utf-8), then close                         (refused)

Clients reuse connections, so this costs one round trip (plus the challenge)
per connection, not per request. After it, a body is a msgpack map::

    {"op": "claim",   "key": K}            -> {"ok": true, "found": false}
                                            | {"ok": true, "found": true, "segment": S, "addr": A, "size": N, "token": T}
    {"op": "finish",  "token": T}          -> {"ok": true, "released": bool}   (false: the claim had lapsed)
    {"op": "finish",  "token": T, "noreply": true}   (one-way: the reader knows its claim was live)
    {"op": "unclaim", "token": T}          -> {"ok": true}
    {"op": "discard", "key": K}            -> {"ok": true, "released": bool}
    {"op": "ping"}                         -> {"ok": true, "segment": S}

Any failure is ``{"ok": false, "error": "..."}``.

The two requests on every ``get``'s path also have a compact binary form
(:func:`claim_request` / :func:`parse_claim_reply`, :func:`finish_notice`): a
frame whose body starts with a byte below 0x80 (a msgpack map never does)::

    0x01 key(utf-8)                          -> 0x00 (not found)
                                              | 0x01 addr:u64 size:u64 token:u64 claim_ttl:f64 segment(utf-8)
                                              | 0x02 error(utf-8)
    0x02 token:u64                           (one-way finish)

Same meaning as the maps, less Python on both ends of the round trip
(the bench's Transfer Engine floor adds one such round trip to the raw read). Every socket operation has a
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
from typing import Any, NamedTuple, TypeVar

import msgpack

from omni_plugins.channel import Channel, FrameError, HandshakeError, Listener, SecretHandshake, set_io_timeout
from omni_plugins.errors import ConnectorError
from omni_plugins_mooncake.config import parse_host_port

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
MAX_FRAME = 64 * 1024
PROTOCOL_VERSION = 2  # 2: every connection starts with the secret handshake
#: the handshake's protocol name (its MACs are over "<this> client\0" / "<this> server\0")
_PROTOCOL = b"omni-plugins mooncake-te control v2"

Handler = Callable[[dict[str, Any]], dict[str, Any]]
FastHandler = Callable[[bytes], "bytes | None"]  # a binary request body -> reply body, or None (one-way)

OP_CLAIM = 0x01
OP_FINISH = 0x02
_CLAIMED = struct.Struct(">QQQd")  # addr, size, token, claim_ttl
_TOKEN = struct.Struct(">Q")
_FOUND, _NOT_FOUND, _FAILED = b"\x01", b"\x00", b"\x02"


class Claim(NamedTuple):
    """Where a claimed payload is: read ``size`` bytes at ``addr`` in ``segment``, then finish ``token``."""

    segment: str
    addr: int
    size: int
    token: int
    claim_ttl: float


class ProtocolError(ConnectorError, FrameError):
    """A peer sent something that is not a valid control frame."""


class PeerUnreachableError(ConnectorError):
    """A peer's control channel could not be reached or stopped answering."""

    def __init__(self, address: str, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.address = address
        self.refused = refused


class AuthenticationError(PeerUnreachableError):
    """The handshake failed: no secret for the peer, the peer refused ours, or it could not prove it knows it."""


def _pack(message: dict[str, Any]) -> bytes:
    return bytes(msgpack.packb(message, use_bin_type=True))


def _unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, max_array_len=64, max_map_len=64, max_ext_len=0)
    except Exception as exc:
        raise ProtocolError(f"control frame is not valid msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("control frame is not a map")
    return message


def claim_request(key: str) -> bytes:
    return bytes((OP_CLAIM,)) + key.encode()


def claim_reply(claim: Claim | None) -> bytes:
    if claim is None:
        return _NOT_FOUND
    return _FOUND + _CLAIMED.pack(claim.addr, claim.size, claim.token, claim.claim_ttl) + claim.segment.encode()


def claim_error(message: str) -> bytes:
    return _FAILED + message.encode()[:1024]


def finish_notice(token: int) -> bytes:
    return bytes((OP_FINISH,)) + _TOKEN.pack(token)


def parse_key(body: bytes) -> str:
    """The key of a binary claim request (``body`` starts with its op byte)."""
    try:
        return body[1:].decode()
    except UnicodeDecodeError:
        raise ProtocolError("claim key is not UTF-8") from None


def parse_token(body: bytes) -> int:
    if len(body) != 1 + _TOKEN.size:
        raise ProtocolError(f"finish notice of {len(body)} bytes")
    return int(_TOKEN.unpack_from(body, 1)[0])


def parse_claim_reply(body: bytes, peer: str) -> Claim | None:
    """A binary claim reply; ``ProtocolError`` when malformed, ``ConnectorError`` when the peer refused."""
    kind = body[:1]
    if kind == _NOT_FOUND and len(body) == 1:
        return None
    if kind == _FOUND and len(body) > 1 + _CLAIMED.size:
        addr, size, token, claim_ttl = _CLAIMED.unpack_from(body, 1)
        try:
            segment = body[1 + _CLAIMED.size :].decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"peer {peer} sent a claim whose segment is not UTF-8") from None
        return Claim(segment, addr, size, token, claim_ttl)
    if kind == _FAILED:
        raise ConnectorError(f"mooncake-te peer {peer} refused 'claim': {body[1:].decode(errors='replace')}")
    raise ProtocolError(f"peer {peer} sent a malformed claim reply ({len(body)} bytes)")


def _channel(sock: socket.socket) -> Channel:
    return Channel(sock, max_frame=MAX_FRAME, error=ProtocolError)


class ControlServer:
    """A tiny threaded TCP server: one daemon thread accepts, one per connection answers.

    Every connection must pass the handshake (module docstring) with ``secret``
    within ``handshake_timeout`` seconds before any request is read; at most
    ``max_pending`` connections may be in the handshake at once (more are closed
    at once), so unauthenticated clients cannot hold many threads.
    """

    def __init__(
        self,
        address: str,
        handler: Handler,
        *,
        secret: bytes,
        fast: FastHandler | None = None,
        idle_timeout: float = 120.0,
        handshake_timeout: float = 5.0,
        max_pending: int = 64,
        name: str = "control",
    ) -> None:
        if not secret:
            raise ValueError("a control server needs a non-empty secret")
        host, _, port = address.rpartition(":")
        self._handler = handler
        self._fast = fast
        self._auth = SecretHandshake(secret, _PROTOCOL, PROTOCOL_VERSION)
        self._idle_timeout = idle_timeout
        self._handshake_timeout = handshake_timeout
        self._name = name
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = Listener(host, int(port), self._serve, max_pending=max_pending, name=name)
        self.address = self._listener.address

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

    def _serve(self, conn: socket.socket, peer: str, admitted: Callable[[], None]) -> None:
        channel = _channel(conn)
        with self._lock:
            self._conns.add(conn)
        try:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                set_io_timeout(conn, self._handshake_timeout)  # an unauthenticated client holds this thread at most this long
                accepted = not self._stopping.is_set() and self._handshake(channel, peer)
            except OSError:
                accepted = False
            finally:
                admitted()
            if not accepted:
                return
            set_io_timeout(conn, self._idle_timeout)  # bounds both waiting for a request and sending a reply
            while not self._stopping.is_set():
                try:
                    body = channel.receive_body()
                    # a binary request starts below 0x80, where no msgpack map does
                    reply = self._answer_fast(body) if body[0] < 0x80 else self._answer(_unpack(body))
                except (OSError, ConnectionError):
                    return
                except ProtocolError as exc:
                    logger.warning("%s %s: dropping a client that sent a bad frame: %s", self._name, self.address, exc)
                    return
                if reply is None:
                    continue
                try:
                    channel.send_body(reply)
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, channel: Channel, peer: object) -> bool:
        """Challenge the client and check its proof (constant time, :mod:`omni_plugins.channel`); True when it knows the secret."""
        try:
            ok = self._auth.accept(channel)
        except (OSError, ConnectionError, FrameError) as exc:
            level = logging.DEBUG if isinstance(exc, ConnectionError) else logging.WARNING  # a client that just hung up is no news
            logger.log(level, "%s %s: closing a connection from %s without a valid handshake: %s", self._name, self.address, peer, exc)
            return False
        if not ok:
            logger.warning("%s %s: refusing a connection from %s: bad handshake (wrong secret?)", self._name, self.address, peer)
        return ok

    def _answer(self, request: dict[str, Any]) -> bytes | None:
        try:
            reply = self._handler(request)
        except Exception as exc:  # a handler bug must not kill the channel silently
            logger.exception("%s %s: request %r failed", self._name, self.address, request.get("op"))
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return None if request.get("noreply") is True else _pack(reply)

    def _answer_fast(self, body: bytes) -> bytes | None:
        if self._fast is None:
            raise ProtocolError(f"binary request {body[0]:#x} on a channel without binary requests")
        try:
            return self._fast(body)
        except ProtocolError:
            raise
        except Exception as exc:
            logger.exception("%s %s: binary request %#x failed", self._name, self.address, body[0])
            return None if body[0] == OP_FINISH else claim_error(f"{type(exc).__name__}: {exc}")


class ControlClient:
    """Requests to one peer over reused connections (one per concurrent caller).

    ``secret`` is the peer's shared secret, or a function returning it (None when
    it is not known), asked each time a connection is opened.
    """

    def __init__(self, address: str, *, secret: bytes | Callable[[], bytes | None], timeout: float, max_idle_age: float = 30.0) -> None:
        self.address = address
        self._host, self._port = parse_host_port(address, what="peer address")
        self._secret = secret
        self._timeout = timeout
        self._max_idle_age = max_idle_age
        self._idle: list[tuple[Channel, float]] = []
        self._lock = threading.Lock()

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return the reply map; raise :class:`PeerUnreachableError` on any I/O failure."""
        message = {"v": PROTOCOL_VERSION, **message}
        reply = _unpack(self._exchange(_pack(message)))
        if reply.get("ok") is not True:
            raise ConnectorError(f"mooncake-te peer {self.address} refused {message.get('op')!r}: {reply.get('error', reply)}")
        return reply

    def claim(self, key: str) -> Claim | None:
        """Claim ``key`` (binary request): where to read it, or None when the peer does not have it (free)."""
        return parse_claim_reply(self._exchange(claim_request(key)), self.address)

    def notify(self, message: dict[str, Any]) -> None:
        """Send a one-way request (``noreply``); raise :class:`PeerUnreachableError` if it cannot be sent."""
        self._send_oneway(_pack({"v": PROTOCOL_VERSION, **message, "noreply": True}))

    def finish(self, token: int) -> None:
        """One-way ``finish`` of a claim (binary); raise :class:`PeerUnreachableError` if it cannot be sent."""
        self._send_oneway(finish_notice(token))

    def _exchange(self, body: bytes) -> bytes:
        return self._on_channel(self._roundtrip, body)

    def _send_oneway(self, body: bytes) -> None:
        self._on_channel(Channel.send_body, body)

    def _on_channel(self, op: Callable[[Channel, bytes], _T], body: bytes) -> _T:
        """``op(channel, body)`` on a pooled connection, which goes back to the pool after it.

        A reused connection that fails is replaced once (the server may have closed it while it was
        idle); a fresh one that fails, or the replacement failing, is :class:`PeerUnreachableError`.
        """
        channel, reused = self._checkout()
        try:
            result = op(channel, body)
        except (OSError, ConnectionError) as exc:
            channel.close()
            if not reused:
                raise self._unreachable(exc) from exc
            channel = self._connect()
            try:
                result = op(channel, body)
            except (OSError, ConnectionError) as exc2:
                channel.close()
                raise self._unreachable(exc2) from exc2
        except ProtocolError:
            channel.close()
            raise
        self._checkin(channel)
        return result

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for channel, _ in idle:
            channel.close()

    def _roundtrip(self, channel: Channel, body: bytes) -> bytes:
        channel.send_body(body)  # each call bounded by `timeout` (set_io_timeout)
        return channel.receive_body()

    def _checkout(self) -> tuple[Channel, bool]:
        now = time.monotonic()
        stale: list[Channel] = []
        found: Channel | None = None
        with self._lock:
            while self._idle:
                channel, since = self._idle.pop()
                if now - since < self._max_idle_age:
                    found = channel
                    break
                stale.append(channel)
        for channel in stale:
            channel.close()
        if found is not None:
            return found, True
        return self._connect(), False

    def _checkin(self, channel: Channel) -> None:
        with self._lock:
            self._idle.append((channel, time.monotonic()))

    def _connect(self) -> Channel:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
        except OSError as exc:
            raise self._unreachable(exc) from exc
        channel = _channel(sock)
        try:
            secret = self._secret() if callable(self._secret) else self._secret
            if not secret:  # checked once connected, so a peer that is down is reported as down
                raise AuthenticationError(
                    self.address,
                    f"mooncake-te: no secret for peer {self.address}: set the same `secret` on the producer and this "
                    f"instance (e.g. secret: ${{OMNI_TE_SECRET}}), or let both use one rendezvous_dir",
                )
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_io_timeout(sock, self._timeout)
            self._handshake(channel, secret)
        except BaseException as exc:
            channel.close()
            if isinstance(exc, (OSError, ConnectionError)):
                raise self._unreachable(exc, during="the handshake") from exc
            raise
        return channel

    def _handshake(self, channel: Channel, secret: bytes) -> None:
        """Answer the server's challenge and check its proof: both sides show they know ``secret``."""
        try:
            SecretHandshake(secret, _PROTOCOL, PROTOCOL_VERSION).prove(channel)
        except HandshakeError as exc:
            peer = f"mooncake-te peer {self.address}"
            if exc.kind == "not-a-server":
                raise ProtocolError(f"{peer} did not open with a control-channel challenge (not a mooncake-te producer?)") from None
            if exc.kind == "version":
                raise ProtocolError(f"{peer} speaks control protocol {exc.theirs}, this instance {PROTOCOL_VERSION}") from None
            if exc.kind == "refused":
                raise AuthenticationError(self.address, f"{peer} refused this instance's secret ({exc.reason})") from None
            if exc.kind == "impostor":
                raise AuthenticationError(
                    self.address, f"{peer} does not know the secret (not the producer configured for that address?)"
                ) from None
            raise ProtocolError(f"{peer}: {exc}") from None

    def _unreachable(self, exc: BaseException, during: str = "") -> PeerUnreachableError:
        what = f"no answer within {self._timeout} s" if isinstance(exc, BlockingIOError) else f"{type(exc).__name__}: {exc}"
        if during:
            what += f", during {during}"
        return PeerUnreachableError(
            self.address,
            f"mooncake-te peer {self.address} is unreachable ({what})",
            refused=isinstance(exc, ConnectionRefusedError),
        )
