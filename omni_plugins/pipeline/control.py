"""The control channel of a pipeline across hosts: one authenticated TCP link per joining host.

The coordinating host (``omni-plugins run ... --serve ADDR``, or the
``placement``'s coordinator) listens; every other host (``--join ADDR``)
connects, proves it knows the shared secret (:class:`omni_plugins.channel.SecretHandshake`,
protocol ``omni-plugins pipeline control v1``; the coordinator proves it too),
and says which stages it runs. Then both sides exchange msgpack maps in
frames: which request to admit or abort, stop, which stage process started,
reported or exited, what a host's leak check found. Never a payload: payloads
travel only through the pipeline's connectors.

Coordinator -> host::

    {"op": "welcome", "run_tag": T, ...} | {"op": "refused", "error": E}
    {"op": "to", "stage": S, "replica": R, "msg": [...]}     (a stage's control message: admit, abort, stop)
    {"op": "kill", "stage": S, "replica": R, "rank": K, "stacks": bool}
    {"op": "collect", "instances": [...]}                    (every stage stopped: leak check and reclaim)
    {"op": "bye", "ok": bool, "table": "..."}                (the run's report; the host exits)

Host -> coordinator::

    {"op": "join", "host": NAME, "stages": [...], "pipeline": SHA256, "version": 1}
    {"op": "spawned", "procs": [[S, R, K, PID], ...]}
    {"op": "stage", "msg": {...}}                            (a stage process's report, as it made it)
    {"op": "exited", "stage": S, "replica": R, "rank": K, "code": C}
    {"op": "collected", "leaks": [...], "reclaimed": [...]}

Both sides send ``{"op": "ping"}`` when they have said nothing for
:data:`HEARTBEAT_S`; a link that hears nothing for its timeout (default
:data:`HOST_TIMEOUT_S`, longer than a brief network partition) is lost: the
coordinator fails the requests of that host's stages naming it, a host stops
its stages. Every send is bounded by the same timeout, so a dead peer never
hangs a thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from omni_plugins.channel import Channel, FrameError, HandshakeError, Listener, SecretHandshake, set_io_timeout
from omni_plugins.config.models import split_host_port
from omni_plugins.errors import ConfigError, OmniPluginsError

logger = logging.getLogger(__name__)

PROTOCOL = b"omni-plugins pipeline control v1"
VERSION = 1
#: a stage's final report (every latency sample of its edges) fits
MAX_MESSAGE = 64 << 20
HEARTBEAT_S = 1.0
#: a host silent this long is lost (a partition shorter than this is survived)
HOST_TIMEOUT_S = 30.0
#: the environment variable holding the shared secret (never on the command line: ``ps`` shows it)
SECRET_ENV = "OMNI_CONTROL_SECRET"
MIN_SECRET_BYTES = 16


class ControlError(OmniPluginsError):
    """The control channel failed: unreachable coordinator, refused join, wrong secret."""


def load_secret(secret_file: str | None) -> bytes:
    """The shared secret: ``secret_file``'s contents (stripped), else ``$OMNI_CONTROL_SECRET``; at least 16 bytes."""
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"--secret-file {secret_file}: {exc.strerror or exc}") from None
        source = f"--secret-file {secret_file}"
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
        source = f"${SECRET_ENV}"
        if not secret:
            raise ConfigError(
                f"a pipeline across hosts needs a shared secret: set {SECRET_ENV} (the same on every host) or pass --secret-file FILE"
            )
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the control secret from {source} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} (e.g. openssl rand -hex 32)"
        )
    return secret


def pipeline_digest(path: str | Path) -> str:
    """SHA-256 of the pipeline file as written: every host must run the same YAML (its variables may differ per host)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _pack(message: dict[str, Any]) -> bytes:
    return bytes(msgpack.packb(message, use_bin_type=True))


def _unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as exc:
        raise FrameError(f"control message is not valid msgpack: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise FrameError("control message is not a map with an 'op'")
    return message


class ControlLink:
    """One authenticated connection to the other side: msgpack maps both ways, heartbeats, loss detection.

    Before :meth:`start` the owner talks with :meth:`send` and :meth:`receive`
    (the join and welcome); after it, a reader thread hands every message but
    pings to ``on_message`` and calls ``on_lost`` once when the link fails or
    falls silent for ``timeout_s``.
    """

    def __init__(self, channel: Channel, peer: str, *, timeout_s: float = HOST_TIMEOUT_S) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        sock = self._sock = channel.sock
        self._channel = channel
        self._send_lock = threading.Lock()
        self._last_sent = self._last_heard = time.monotonic()
        self._lost: str | None = None
        self._lost_lock = threading.Lock()
        self._on_lost: Callable[[str], None] | None = None
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_io_timeout(sock, timeout_s)

    @property
    def lost(self) -> str | None:
        """Why the link is down (None while it is up)."""
        return self._lost

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the link is (or just went) down. Never raises."""
        if self._lost is not None:
            return False
        body = _pack(message)
        try:
            with self._send_lock:
                self._channel.send_body(body)
                self._last_sent = time.monotonic()
        except (OSError, FrameError) as exc:
            self._fail(f"sending failed: {_describe(exc, self.timeout_s)}")
            return False
        return True

    def receive(self, timeout: float) -> dict[str, Any]:
        """The next message, waiting at most ``timeout`` s (before :meth:`start` only)."""
        set_io_timeout(self._sock, self.timeout_s, receive=timeout)
        try:
            return _unpack(self._channel.receive_body())
        except (OSError, ConnectionError) as exc:
            raise ControlError(f"control link to {self.peer}: {_describe(exc, timeout)}") from None
        finally:
            set_io_timeout(self._sock, self.timeout_s)

    def start(self, on_message: Callable[[dict[str, Any]], None], on_lost: Callable[[str], None], *, name: str = "omni-control") -> None:
        """Read in a thread from now on; heartbeats in another."""
        self._on_lost = on_lost
        set_io_timeout(self._sock, self.timeout_s, receive=None)  # the watchdog wakes a reader stuck on a dead link
        if self._lost is not None:
            on_lost(self._lost)
            return
        self._threads = [
            threading.Thread(target=self._read, args=(on_message,), name=f"{name}-read", daemon=True),
            threading.Thread(target=self._watch, name=f"{name}-beat", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def close(self, reason: str = "closed") -> None:
        """Close the link (idempotent); ``on_lost`` is not called for a close asked for here."""
        self._closing.set()
        with self._lost_lock:
            if self._lost is None:
                self._lost = reason
        self._shutdown()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5)
        self._sock.close()

    def _read(self, on_message: Callable[[dict[str, Any]], None]) -> None:
        while self._lost is None:
            try:
                body = self._channel.receive_body()
                message = _unpack(body)
            except (OSError, ConnectionError, FrameError) as exc:
                self._fail(_describe(exc, self.timeout_s))
                return
            self._last_heard = time.monotonic()
            if message["op"] == "ping":
                continue
            try:
                on_message(message)
            except Exception:
                logger.exception("control link %s: handling %r failed", self.peer, message.get("op"))

    def _watch(self) -> None:
        while not self._closing.wait(HEARTBEAT_S / 2):
            now = time.monotonic()
            if now - self._last_heard > self.timeout_s:
                self._fail(f"nothing heard for {self.timeout_s:.0f} s")
                return
            if now - self._last_sent >= HEARTBEAT_S and not self.send({"op": "ping"}):
                return

    def _fail(self, reason: str) -> None:
        with self._lost_lock:
            if self._lost is not None:
                return
            self._lost = reason
        self._shutdown()
        if self._on_lost is not None and not self._closing.is_set():
            self._on_lost(reason)

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, BlockingIOError):
        return f"no answer within {timeout:.0f} s"
    if type(exc) is ConnectionError:  # what a Channel raises when the peer hung up
        return "connection closed by the other side"
    return f"{type(exc).__name__}: {exc}"


class ControlServer:
    """The coordinating host's listener: authenticates each host and hands its join message to ``on_join``.

    A connection that does not complete the handshake and send its join within
    ``handshake_timeout`` is dropped; at most ``max_pending`` may be in the
    handshake at once, so strangers cannot hold many threads.
    """

    def __init__(
        self,
        address: str,
        secret: bytes,
        on_join: Callable[[ControlLink, dict[str, Any]], None],
        *,
        timeout_s: float = HOST_TIMEOUT_S,
        handshake_timeout: float = 10.0,
        max_pending: int = 16,
    ) -> None:
        host, port = _split(address, "--serve", any_port=True)
        self._auth = SecretHandshake(secret, PROTOCOL, VERSION)
        self._on_join = on_join
        self._timeout_s = timeout_s
        self._handshake_timeout = handshake_timeout
        try:
            self._listener = Listener(host, port, self._admit, max_pending=max_pending, name="omni-control", backlog=16)
        except OSError as exc:
            raise ControlError(f"cannot serve the control channel on {address}: {exc.strerror or exc}") from None
        self.address = self._listener.address

    def close(self) -> None:
        self._listener.close()

    def _admit(self, conn: socket.socket, peer: str, admitted: Callable[[], None]) -> None:
        link: ControlLink | None = None
        try:
            set_io_timeout(conn, self._handshake_timeout)
            channel = Channel(conn, max_frame=MAX_MESSAGE)
            if not self._auth.accept(channel):
                logger.warning("control channel %s: refused a connection from %s: wrong secret", self.address, peer)
                conn.close()
                return
            link = ControlLink(channel, peer, timeout_s=self._timeout_s)
            hello = link.receive(self._handshake_timeout)
            if hello.get("op") != "join":
                raise FrameError(f"expected a join, got {hello.get('op')!r}")
        except (OSError, ConnectionError, FrameError, ControlError) as exc:
            logger.warning("control channel %s: dropped a connection from %s: %s", self.address, peer, exc)
            conn.close()
            return
        finally:
            admitted()
        self._on_join(link, hello)


def _split(address: str, what: str, *, any_port: bool = False) -> tuple[str, int]:
    try:
        return split_host_port(address, any_port=any_port)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def connect(address: str, secret: bytes, *, wait_s: float, timeout_s: float = HOST_TIMEOUT_S) -> ControlLink:
    """Connect to the coordinating host at ``address`` (retrying for ``wait_s`` while nobody listens) and authenticate."""
    host, port = _split(address, "--join")
    deadline = time.monotonic() + wait_s
    delay = 0.1
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=min(10.0, max(1.0, wait_s)))
            break
        except OSError as exc:
            if time.monotonic() + delay > deadline:
                raise ControlError(
                    f"cannot reach the coordinating host at {address} within {wait_s:.0f} s: {exc.strerror or exc}"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    channel = Channel(sock, max_frame=MAX_MESSAGE)
    try:
        set_io_timeout(sock, timeout_s)
        SecretHandshake(secret, PROTOCOL, VERSION).prove(channel)
    except HandshakeError as exc:
        sock.close()
        if exc.kind in ("refused", "impostor"):
            raise ControlError(f"the coordinating host at {address} and this host do not share the control secret ({exc})") from None
        raise ControlError(f"{address} is not an omni-plugins control channel ({exc})") from None
    except (OSError, ConnectionError, FrameError) as exc:
        sock.close()
        raise ControlError(f"the handshake with {address} failed: {_describe(exc, timeout_s)}") from None
    return ControlLink(channel, address, timeout_s=timeout_s)
