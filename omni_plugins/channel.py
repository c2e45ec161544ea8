"""Framed TCP with a shared-secret handshake: the wire under every control channel.

Two users: the control channel that joins the hosts of one pipeline
(:mod:`omni_plugins.pipeline.control`) and plugins' own control channels
(mooncake-te's producers answer claims over it). Neither carries payloads.

Frame: a 4-byte big-endian length, then the body (not empty, at most
``max_frame`` bytes).

Handshake (:class:`SecretHandshake`): every connection starts by proving, both
ways, knowledge of a shared secret -- HMAC-SHA256 over two fresh nonces, so the
secret never crosses the wire and a recorded exchange cannot be replayed. The
server sends nothing but the challenge and its verdict before a valid proof::

    server -> 0x10 version:u8 server_nonce(32)                            (challenge, on accept)
    client -> 0x11 client_nonce(32) HMAC(secret, P" client\\0" | Ns | Nc)  (proof)
    server -> 0x12 HMAC(secret, P" server\\0" | Ns | Nc)                   (accepted: the client checks it)
            | 0x13 reason(utf-8), then close                               (refused)

``P`` is the protocol's name (a different protocol's proof never passes). Both
proofs are compared with :func:`hmac.compare_digest` (constant time); a
malformed proof is compared too, against a value it cannot match, so timing
says nothing about the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Protocol

from omni_plugins.errors import OmniPluginsError

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
_TIMEVAL = struct.Struct("@ll")  # struct timeval
_RECV_SIZE = 4096  # a control message fits; bigger frames take more calls
#: the largest frame a :class:`Channel` sends or accepts unless told otherwise
MAX_FRAME = 64 * 1024

HELLO_CHALLENGE, HELLO_PROOF, HELLO_ACCEPTED, HELLO_REFUSED = 0x10, 0x11, 0x12, 0x13
NONCE = 32  # bytes of each side's nonce; the MACs are SHA-256 (32 bytes)
_PROOF_SIZE = 1 + NONCE + 32
#: the longest frame read before a connection is authenticated
HELLO_MAX = 1024


class FrameError(OmniPluginsError):
    """A peer sent something that is not a valid frame (too long, empty, malformed)."""


class HandshakeError(OmniPluginsError):
    """The client side of the handshake failed; :attr:`kind` says how.

    ``not-a-server`` (the peer did not open with a challenge), ``version`` (it speaks another
    version: :attr:`theirs`), ``refused`` (it refused our proof: :attr:`reason`), ``malformed``
    (its verdict is not one) or ``impostor`` (it accepted, but cannot prove it knows the secret).
    """

    def __init__(self, kind: str, message: str, *, theirs: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.theirs = theirs
        self.reason = reason


def set_io_timeout(sock: socket.socket, seconds: float, *, receive: float | None = -1.0) -> None:
    """Make ``sock`` blocking, with every send/receive bounded by the kernel (``SO_SNDTIMEO``/``SO_RCVTIMEO``).

    ``receive`` bounds receives differently: None waits for ever (a reader thread that
    something else wakes); the default, ``seconds`` too. Not ``socket.settimeout``: Python
    then polls before every call, an extra system call each way, a large part of a
    loopback round trip. A call that runs out of time raises ``BlockingIOError`` (an ``OSError``).
    """
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds if receive is not None and receive < 0 else receive))


def _timeval(seconds: float | None) -> bytes:
    if seconds is None:
        return _TIMEVAL.pack(0, 0)  # no bound
    micros = max(1, round(seconds * 1e6))  # 0 would mean "forever"
    return _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)


class Channel:
    """One connection: frames out, frames in, read with as few ``recv`` calls as possible.

    Received bytes are buffered, so a frame usually costs one ``recv`` (not one
    for the length and one for the body), and two frames that arrive together
    are both kept. Bad frames raise ``error`` (:class:`FrameError` or a subclass
    the owner prefers); a peer that hung up, ``ConnectionError``; a timeout or a
    broken socket, ``OSError``.
    """

    __slots__ = ("_error", "_max", "_pending", "sock")

    def __init__(self, sock: socket.socket, *, max_frame: int = MAX_FRAME, error: type[FrameError] = FrameError) -> None:
        self.sock = sock
        self._pending = b""
        self._max = max_frame
        self._error = error

    def send_body(self, body: bytes) -> None:
        if len(body) > self._max:
            raise self._error(f"control message of {len(body)} bytes exceeds {self._max}")
        self.sock.sendall(_LEN.pack(len(body)) + body)

    def receive_body(self, limit: int | None = None) -> bytes:
        """The next frame's body (not empty, at most ``limit`` bytes, default the channel's ``max_frame``)."""
        limit = self._max if limit is None else limit
        buf = self._pending
        while len(buf) < _LEN.size:
            buf += self._recv()
        (length,) = _LEN.unpack_from(buf)
        if length > limit:
            raise self._error(f"control frame of {length} bytes exceeds {limit}")
        if length == 0:
            raise self._error("empty control frame")
        end = _LEN.size + length
        while len(buf) < end:
            buf += self._recv()
        self._pending = buf[end:]
        return buf[_LEN.size : end]

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> bytes:
        data = self.sock.recv(_RECV_SIZE)
        if not data:
            raise ConnectionError("connection closed by peer")
        return data


class Framed(Protocol):
    """What the handshake talks over (a :class:`Channel`)."""

    def send_body(self, body: bytes) -> None: ...

    def receive_body(self, limit: int | None = None) -> bytes: ...


class SecretHandshake:
    """Both ends of the handshake (module docstring) for one protocol name, version and secret."""

    def __init__(self, secret: bytes, protocol: bytes, version: int) -> None:
        if not secret:
            raise ValueError("a handshake needs a non-empty secret")
        if not 0 <= version <= 255:
            raise ValueError(f"protocol version must fit a byte, got {version}")
        self._secret = secret
        self._client_label = protocol + b" client\0"
        self._server_label = protocol + b" server\0"
        self.version = version

    def _mac(self, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
        return hmac.new(self._secret, label + server_nonce + client_nonce, hashlib.sha256).digest()

    def accept(self, channel: Framed) -> bool:
        """Server side: challenge, check the proof, answer; True when the client knows the secret.

        I/O errors (``OSError``, ``ConnectionError``) and bad frames (:class:`FrameError`) propagate:
        the caller closes the connection either way.
        """
        server_nonce = os.urandom(NONCE)
        channel.send_body(bytes((HELLO_CHALLENGE, self.version)) + server_nonce)
        proof = channel.receive_body(HELLO_MAX)
        client_nonce = proof[1 : 1 + NONCE]
        expected = self._mac(self._client_label, server_nonce, client_nonce)
        ok = hmac.compare_digest(proof[1 + NONCE :] if len(proof) == _PROOF_SIZE else b"", expected)
        ok = ok and proof[0] == HELLO_PROOF
        if ok:
            channel.send_body(bytes((HELLO_ACCEPTED,)) + self._mac(self._server_label, server_nonce, client_nonce))
        else:
            channel.send_body(bytes((HELLO_REFUSED,)) + b"authentication failed")
        return ok

    def prove(self, channel: Framed) -> None:
        """Client side: answer the challenge and check the server's proof; :class:`HandshakeError` when it fails."""
        challenge = channel.receive_body(HELLO_MAX)
        if len(challenge) != 2 + NONCE or challenge[0] != HELLO_CHALLENGE:
            raise HandshakeError("not-a-server", "the peer did not open with a handshake challenge")
        if challenge[1] != self.version:
            raise HandshakeError("version", f"the peer speaks version {challenge[1]}, this end {self.version}", theirs=challenge[1])
        server_nonce, client_nonce = challenge[2:], os.urandom(NONCE)
        channel.send_body(bytes((HELLO_PROOF,)) + client_nonce + self._mac(self._client_label, server_nonce, client_nonce))
        verdict = channel.receive_body(HELLO_MAX)
        if verdict[0] == HELLO_REFUSED:
            reason = verdict[1:].decode(errors="replace")
            raise HandshakeError("refused", f"the peer refused this end's secret ({reason})", reason=reason)
        if verdict[0] != HELLO_ACCEPTED or len(verdict) != 33:
            raise HandshakeError("malformed", f"the peer sent a malformed handshake verdict ({len(verdict)} bytes)")
        if not hmac.compare_digest(verdict[1:], self._mac(self._server_label, server_nonce, client_nonce)):
            raise HandshakeError("impostor", "the peer does not know the secret")


#: what a :class:`Listener` runs for each connection: ``serve(conn, peer, admitted)``
Serve = Callable[[socket.socket, str, Callable[[], None]], None]


class Listener:
    """The server side's TCP listener: one daemon thread accepts, one thread per connection runs ``serve``.

    At most ``max_pending`` connections may be between their accept and their
    ``admitted()`` call (what ``serve`` calls once the handshake is over, passed or
    not; at the latest when it returns) at once: more are closed at once, so
    clients that never finish a handshake cannot hold many threads. ``serve`` owns
    its connection (it closes it, or hands it on).
    """

    def __init__(self, host: str, port: int, serve: Serve, *, max_pending: int, name: str, backlog: int = 64) -> None:
        self._serve = serve
        self._max_pending = max_pending
        self._name = name
        self._pending = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._sock = socket.create_server((host.strip("[]"), port), backlog=backlog)
        self._sock.settimeout(0.25)  # lets the accept loop notice close()
        bound = self._sock.getsockname()
        self.address = f"{bound[0]}:{bound[1]}"
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting (connections already served are their ``serve``'s)."""
        self._stopping.set()
        self._sock.close()
        self._acceptor.join(5)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with self._lock:
                full = self._pending >= self._max_pending
                if not full:
                    self._pending += 1
            where = f"{peer[0]}:{peer[1]}"
            if full:
                logger.warning("%s %s: %d connections already in the handshake; closing one from %s", self._name, self.address, self._max_pending, where)
                conn.close()
                continue
            threading.Thread(target=self._run, args=(conn, where), name=f"{self._name}-conn", daemon=True).start()

    def _run(self, conn: socket.socket, peer: str) -> None:
        released = False

        def admitted() -> None:
            nonlocal released
            if not released:
                released = True
                with self._lock:
                    self._pending -= 1

        try:
            self._serve(conn, peer, admitted)
        finally:
            admitted()
