"""Connections, per-server pools, cluster slot routing and retry with backoff.

Every socket has a timeout (connect and I/O), so no call waits forever. A
failed connection is dropped, never reused. :meth:`RedisClient.run` retries a
step after connection failures, ``LOADING`` (a restarted server reading its
AOF), ``MOVED``/``ASK``/``CLUSTERDOWN``/``TRYAGAIN`` (cluster changes) with
exponential backoff, and turns the final failure into a
:class:`~omni_plugins.errors.ConnectorError` naming the server and the key.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from omni_plugins.errors import ConnectorClosedError, ConnectorError
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.framing import Arg, Buffer, ProtocolError, Reply, ReplyError, ReplyReader, pack_many, send_buffers
from omni_plugins_redis.timeouts import set_receive_timeout, use_kernel_timeouts

log = logging.getLogger(__name__)

#: SO_LINGER on with a zero timeout: close() resets the connection, dropping unsent data
_LINGER_RESET = struct.pack("ii", 1, 0)

T = TypeVar("T")
SLOTS = 16384
_RETRYABLE_REPLIES = frozenset({"LOADING", "MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "READONLY"})
_TRANSIENT_REPLIES = frozenset({"LOADING", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "BUSY"})
_AUTH_REPLIES = frozenset({"WRONGPASS", "NOAUTH", "NOPERM"})
# How long close() waits, in all, for the replies of deferred commands it sends (a stalled server must not hold it up).
CLOSE_SETTLE_S = 2.0


class AuthError(ConnectorError):
    """The server rejected our credentials or the ACL user lacks a permission (not retried)."""


class Address(NamedTuple):
    """A TCP ``host:port`` or a unix socket ``path`` (a tuple: hashed in C on every routed step)."""

    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.path else f"{self.host}:{self.port}"


class Connection:
    """One RESP2 socket to one server.

    ``defer`` sends a command whose reply nobody waits for (e.g. deleting a
    consumed payload): the reply is read and checked lazily before the next
    reply, so the cleanup costs no extra round trip.

    :meth:`abort` (from another thread, when the client closes) makes a call
    blocked on the socket fail at once; the owner may then queue last commands
    behind what it sent (:meth:`send_last`).
    """

    def __init__(self, address: Address, config: RedisConfig, *, handshake: bool = True) -> None:
        """``handshake=False``: the caller runs :meth:`handshake` (so it can register the connection first)."""
        self.address = address
        self._config = config
        self._sent: deque[tuple[Arg, ...]] = deque()  # deferred, sent, reply not read yet
        self._outbox: list[tuple[Arg, ...]] = []  # deferred, not sent yet
        self._outbox_frames: list[bytes] = []  # their RESP framing (framed once, when deferred)
        self._retired: list[list[bytes]] = []  # consumed payloads' parts, one list per payload (see retire)
        self.broken = False
        self.aborted = False  # abort() ran: the socket no longer delivers replies
        self._sending = False  # a send is under way (abort then shuts the write side too)
        self._write_shut = False  # nothing more can be sent (or the stream ends inside a command)
        self._fd_lock = threading.Lock()  # close() and abort() never touch a descriptor the other already closed
        self._sock = self._open()
        self._kernel_timeouts = not isinstance(self._sock, ssl.SSLSocket)
        if self._kernel_timeouts:
            use_kernel_timeouts(self._sock, config.socket_timeout)
        self._reader = ReplyReader(self._sock)
        if handshake:
            self.handshake()

    def _open(self) -> socket.socket:
        cfg = self._config
        sock: socket.socket
        if self.address.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(cfg.connect_timeout)
            try:
                sock.connect(self.address.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.address.host, self.address.port), timeout=cfg.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cfg.tls:
                context = ssl.create_default_context(cafile=str(cfg.tls_ca_file) if cfg.tls_ca_file else None)
                context.check_hostname = cfg.tls_check_hostname
                if cfg.tls_cert_file and cfg.tls_key_file:
                    context.load_cert_chain(str(cfg.tls_cert_file), str(cfg.tls_key_file))
                try:
                    sock = context.wrap_socket(sock, server_hostname=self.address.host)
                except BaseException:
                    sock.close()
                    raise
        sock.settimeout(cfg.socket_timeout)
        return sock

    def handshake(self) -> None:
        """Authenticate and select the database (closes the connection on failure)."""
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> None:
        cfg = self._config
        commands: list[Sequence[Arg]] = []
        if cfg.password is not None:
            secret = cfg.password.get_secret_value()
            commands.append(("AUTH", cfg.username, secret) if cfg.username else ("AUTH", secret))
        elif cfg.username:
            raise AuthError(f"Redis {self.address}: username {cfg.username!r} given without a password")
        if cfg.db:
            commands.append(("SELECT", cfg.db))
        if not commands:
            return
        self.send_many(commands)
        for reply in [self.read() for _ in commands]:
            if isinstance(reply, ReplyError):
                if reply.code in _AUTH_REPLIES:
                    user = cfg.username or "default"
                    raise AuthError(f"Redis {self.address} rejected user {user!r}: {reply} (check username/password)")
                raise ConnectorError(f"Redis {self.address}: connection setup failed: {reply}")

    # -- I/O ---------------------------------------------------------------
    def send(self, *args: Arg) -> None:
        self.send_many([args])

    def send_many(self, commands: Sequence[Sequence[Arg]]) -> None:
        """Send commands in one write, preceded by any deferred commands not yet sent."""
        framed = pack_many(commands)
        if self._outbox or self._retired:
            framed = [*self._take_outbox(), *framed]
        self._send(framed)

    def send_packed(self, framed: Sequence[Buffer]) -> None:
        """Like :meth:`send_many` for commands already framed with :func:`pack_many` (reused across retries)."""
        if self._outbox or self._retired:
            framed = [*self._take_outbox(), *framed]
        self._send(framed)

    def send_frame(self, frame: bytes) -> None:
        """Send one framed ``bytes`` (the hot path of small puts and gets) with any deferred commands, in one write."""
        if self._outbox or self._retired:
            frame = b"".join([*self._take_outbox(), frame])
        self._sending = True  # before the check: abort() either sees it (and stops the send) or is seen here
        try:
            if self.aborted:
                raise self._aborted_error()
            try:
                self._sock.sendall(frame)
            except BaseException:
                self._write_shut = True  # a command may have gone out cut short
                raise
        except BlockingIOError:
            raise TimeoutError(f"timed out sending to Redis {self.address}") from None
        finally:
            self._sending = False

    def _send(self, framed: Sequence[Buffer]) -> None:
        self._sending = True  # see send_frame
        try:
            if self.aborted:
                raise self._aborted_error()
            try:
                send_buffers(self._sock, framed)
            except BaseException:
                self._write_shut = True  # a command may have gone out cut short
                raise
        finally:
            self._sending = False

    def _aborted_error(self) -> ConnectionAbortedError:
        return ConnectionAbortedError(f"connection to Redis {self.address} aborted (the client is closing)")

    def _take_outbox(self) -> list[bytes]:
        """The frames of the deferred commands about to be sent (their replies are read first)."""
        if self._retired:  # this write is not a parted put: delete them with it
            for group in self.take_retired():
                self._queue(("UNLINK", *group))
        frames = self._outbox_frames
        self._sent.extend(self._outbox)
        self._outbox.clear()
        self._outbox_frames = []
        return frames

    def skip(self, expected: re.Pattern[bytes]) -> bool:
        """Consume the next replies if they match ``expected`` (see :meth:`ReplyReader.skip`)."""
        if self._sent:
            self._drain()
        return self._reader.skip(expected)

    def defer(self, *args: Arg, flush: bool = False, frame: bytes | None = None) -> None:
        """Queue an idempotent command whose reply is read later (errors are logged, not raised).

        The command rides along with the next write on this connection (no extra
        system call or server wake-up); ``flush`` sends it now instead (e.g.
        deleting big parts, to free server memory at once). If the connection
        dies first, :meth:`unconfirmed` hands it back so the pool re-sends it.
        ``frame`` is the command's RESP framing when the caller already has it.
        """
        self._queue(args, frame)
        if flush or not self._config.lazy_cleanup:
            self.send_many([])

    def retire(self, keys: Sequence[bytes]) -> None:
        """Delete these keys (a consumed payload's parts) later, one by one, interleaved with the next parted put.

        Redis's allocator returns freed memory to the kernel within milliseconds,
        so a put that follows a get faults in fresh pages for every part; deleting
        each old part right before a new one arrives lets the server reuse that
        memory. Any other write on this connection deletes them at once; they are
        re-sent like deferred commands if the connection dies. ``keys`` are the
        parts of one payload (one hash tag: one multi-key delete is allowed).
        """
        self._retired.append(list(keys))

    def take_retired(self) -> list[list[bytes]]:
        """The retired keys, one list per payload, now the caller's to delete (see :meth:`retire`)."""
        groups, self._retired = self._retired, []
        return groups

    def _queue(self, args: tuple[Arg, ...], frame: bytes | None = None) -> None:
        self._outbox.append(args)
        self._outbox_frames.append(frame if frame is not None else b"".join(pack_many([args])))

    def _drain(self) -> None:
        """Read the replies of deferred commands already sent (they precede any other reply)."""
        if self._reader.skip_integers(len(self._sent)):  # the usual case: every delete answered with a count
            self._sent.clear()
            return
        while self._sent:
            reply = self._reader.read()
            command = self._sent.popleft()
            if isinstance(reply, ReplyError):
                if reply.code in _TRANSIENT_REPLIES:
                    self._queue(command)  # e.g. LOADING after a restart: send again with the next write
                else:
                    log.warning("Redis %s: deferred %s failed: %s", self.address, command[0], reply)

    def settle(self, timeout: float | None = None) -> None:
        """Send and confirm all deferred commands now; ``timeout`` bounds the wait for their replies."""
        if self._outbox or self._retired:
            self.send_many([])
        if timeout is not None and self._sent:
            self._set_read_timeout(timeout)
        self._drain()

    def unconfirmed(self) -> list[tuple[Arg, ...]]:
        """Deferred commands not known to have run (taken out of this connection)."""
        commands = [*self._sent, *self._outbox]
        commands += [("UNLINK", *group) for group in self.take_retired()]
        self._sent.clear()
        self._outbox.clear()
        self._outbox_frames = []
        return commands

    def read(self, timeout: float | None = None) -> Reply:
        """Read the next reply; ``timeout`` overrides the socket timeout for this read."""
        if self._sent:
            self._drain()
        if timeout is None:
            return self._reader.read()
        self._set_read_timeout(timeout)
        try:
            return self._reader.read()
        finally:
            self._set_read_timeout(self._config.socket_timeout)

    def _set_read_timeout(self, seconds: float) -> None:
        if self._kernel_timeouts:
            set_receive_timeout(self._sock, seconds)
        else:
            self._sock.settimeout(seconds)

    def read_pair(self) -> tuple[Reply, Reply]:
        """The next two replies (see :meth:`ReplyReader.read_pair`)."""
        if self._sent:
            self._drain()
        return self._reader.read_pair()

    def read_bulk_into(self, dest: memoryview) -> bool:
        self._drain()
        return self._reader.read_bulk_into(dest)

    def read_bulk_size(self) -> int:
        """The size of the next bulk reply (-1: nil), its body left for :meth:`read_bulk_body` (see :class:`ReplyReader`)."""
        self._drain()
        return self._reader.read_bulk_size()

    def read_bulk_body(self, dest: memoryview) -> None:
        self._reader.read_body_into(dest)

    def call(self, *args: Arg) -> Reply:
        """One command, one reply; raises :class:`ReplyError` on an error reply."""
        self.send(*args)
        reply = self.read()
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def abort(self) -> None:
        """Make the call blocked on this connection fail now (thread-safe; the client is closing).

        Shuts the receive side down (a blocked read ends at once), and the send
        side too if a send is under way (a send blocked by a stalled server ends
        at once; the command it cut short is dropped by the server). The
        descriptor stays open for the thread that owns the connection: it may
        still queue commands with :meth:`send_last`, then drops it.
        """
        self.aborted = True
        with self._fd_lock:
            if self.broken:
                return
            how = socket.SHUT_RDWR if self._sending else socket.SHUT_RD
            if how == socket.SHUT_RDWR:
                self._write_shut = True
            with contextlib.suppress(OSError):
                socket.socket.shutdown(self._sock, how)  # the plain socket's: an SSLSocket's own would unwrap it

    def send_last(self, commands: Sequence[Sequence[Arg]]) -> bool:
        """After :meth:`abort`: queue ``commands`` behind everything sent, end the stream, wait for nothing.

        The server runs them after what it already received from this
        connection, even one that is stalled now and resumes later (e.g. to
        withdraw a put whose commit may still be executed). Never blocks: False
        when they could not all be queued (send side shut or a command cut
        short, TLS, full send buffer); a command cut short is dropped by the server.
        """
        if self._write_shut or self.broken or isinstance(self._sock, ssl.SSLSocket):
            return False
        self._write_shut = True
        data = memoryview(b"".join(bytes(b) for b in pack_many(commands)))
        sent = 0
        try:
            while sent < len(data):
                sent += self._sock.send(data[sent:], socket.MSG_DONTWAIT)
        except OSError as exc:
            log.debug("Redis %s: last commands not queued (%s)", self.address, exc)
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._sock, socket.SHUT_WR)
        return sent == len(data)

    def close(self, *, reset: bool = False) -> None:
        """Close the socket. ``reset``: abortively (RST), dropping whatever the kernel still holds to send.

        A connection whose call failed half-way may still hold a command the server has not
        received (a partition: the kernel keeps retransmitting it). Closed gracefully, that
        command could reach the server after the heal -- after a retry on a new connection
        already ran it once (a commit twice: a duplicate payload). Reset, it never arrives.
        """
        with self._fd_lock:
            self.broken = True
            with contextlib.suppress(OSError):
                if reset:
                    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                self._sock.close()


class NodePool:
    """At most ``size`` connections to one server; idle ones are reused.

    One plain lock guards the idle list and the connections in use (a
    condition variable is touched only when the pool is full): the hot path of a
    small get or put is one lock round each way. Once closed, nothing is handed
    out and the connections in use are aborted (:meth:`Connection.abort`).
    """

    def __init__(self, address: Address, config: RedisConfig) -> None:
        self.address = address
        self._config = config
        self._idle: list[Connection] = []
        self._redo: list[tuple[Arg, ...]] = []  # deferred commands of connections that died
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._busy = 0  # connections handed out or being opened (counted against pool_size)
        self._in_use: set[Connection] = set()  # handed out: close() aborts them
        self._waiters = 0
        self._closed = False

    def use(self, step: Callable[[Connection], T]) -> T:
        """Run ``step`` on a pooled connection; a connection that saw an exception is dropped."""
        conn = self._acquire()
        try:
            result = step(conn)
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        return result

    def _closed_error(self) -> ConnectorClosedError:
        return ConnectorClosedError(f"Redis {self.address}: the client is closed")

    def _acquire(self) -> Connection:
        cfg = self._config
        with self._lock:
            if self._closed:
                raise self._closed_error()
            if self._busy >= cfg.pool_size:
                deadline = time.monotonic() + cfg.pool_timeout
                self._waiters += 1
                try:
                    while self._busy >= cfg.pool_size:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise ConnectorError(
                                f"Redis {self.address}: all {cfg.pool_size} pooled connections busy for {cfg.pool_timeout}s"
                            )
                        self._freed.wait(remaining)
                        if self._closed:
                            raise self._closed_error()
                finally:
                    self._waiters -= 1
            self._busy += 1
            conn = self._idle.pop() if self._idle else None
            if conn is not None:
                self._in_use.add(conn)
            redo = self._redo
            if redo:
                self._redo = []
        try:
            if conn is None:
                conn = Connection(self.address, cfg, handshake=False)
                with self._lock:
                    if self._closed:
                        raise self._closed_error()
                    self._in_use.add(conn)  # from here on close() aborts it (a handshake may meet a stalled server)
                conn.handshake()
            for command in redo:
                conn.defer(*command)
        except BaseException:
            with self._lock:
                if conn is not None:
                    self._in_use.discard(conn)
                self._redo[:0] = redo
                self._unbusy()
            if conn is not None:
                conn.close()
            raise
        return conn

    def _unbusy(self) -> None:
        """One connection fewer in use (caller holds the lock)."""
        self._busy -= 1
        if self._waiters:
            self._freed.notify()

    def _release(self, conn: Connection) -> None:
        with self._lock:
            self._in_use.discard(conn)
            keep = not (self._closed or conn.broken or conn.aborted)
            if keep:
                self._idle.append(conn)
            self._unbusy()
        if not keep:
            conn.close()

    def _discard(self, conn: Connection) -> None:
        with self._lock:  # out of the set before the descriptor closes: close() never aborts a closed one
            self._in_use.discard(conn)
            self._redo.extend(conn.unconfirmed())
            self._unbusy()
        # state unknown (half-read reply?): never reuse, and nothing still unsent may reach the server later; but what
        # close() queued behind an aborted call (send_last: a withdrawal) must still go out
        conn.close(reset=not conn.aborted)

    def close(self, settle_deadline: float) -> None:
        """Abort the connections in use; close idle ones after confirming their deferred commands until ``settle_deadline``.

        A deferred command (a delete) is sent in any case; only its reply is not
        waited for past the deadline (monotonic), so a stalled server cannot hold
        ``close`` up. The pool stays closed: it hands out nothing more.
        """
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            redo, self._redo = self._redo, []
            busy = list(self._in_use)
            self._freed.notify_all()
        for conn in busy:
            conn.abort()
        for conn in idle:
            try:
                for command in redo:
                    conn.defer(*command)
                redo = []
                conn.settle(timeout=max(settle_deadline - time.monotonic(), 0.001))
            except OSError as exc:
                log.debug("Redis %s: deferred cleanup not confirmed at close: %s (keys expire by TTL)", self.address, exc)
            conn.close()
        if redo:
            log.debug("Redis %s: %d deferred cleanup command(s) dropped at close (keys expire by TTL)", self.address, len(redo))


class RedisClient:
    """Routes each step to the right server and retries it; one instance per connector."""

    def __init__(self, config: RedisConfig) -> None:
        self._config = config
        self.label = config.server_label()
        self._lock = threading.Lock()
        self._pools: dict[Address, NodePool] = {}
        self._closed = threading.Event()
        self._slot_map: list[Address] | None = None
        if config.unix_socket:
            self._seeds = [Address(path=config.unix_socket)]
        else:
            self._seeds = [Address(host=h, port=p) for h, p in config.nodes()]

    # -- routing -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _pool(self, address: Address) -> NodePool:
        """The pool of ``address`` (closed pools stay, so a closed client never opens a new one)."""
        pool = self._pools.get(address)
        if pool is not None:
            return pool
        with self._lock:
            pool = self._pools.get(address)
            if pool is None:
                if self._closed.is_set():
                    raise ConnectorClosedError(f"Redis {address}: the client is closed")
                pool = self._pools[address] = NodePool(address, self._config)
            return pool

    def _address_for(self, slot: int) -> Address:
        if not self._config.cluster:
            return self._seeds[0]
        slot_map = self._slot_map
        if slot_map is None:
            slot_map = self._refresh_slots()
        return slot_map[slot]

    def _refresh_slots(self) -> list[Address]:
        """Ask the known nodes for ``CLUSTER SLOTS`` until one answers."""
        errors: list[str] = []
        candidates = list(dict.fromkeys([*self._seeds, *(self._slot_map or [])]))
        for address in candidates:
            try:
                reply = self._pool(address).use(lambda conn: conn.call("CLUSTER", "SLOTS"))
            except (OSError, ReplyError, ConnectorError) as exc:
                errors.append(f"{address}: {exc}")
                continue
            slot_map = _parse_cluster_slots(reply, address)
            if slot_map is not None:
                self._slot_map = slot_map
                return slot_map
            errors.append(f"{address}: incomplete slot coverage")
        raise ConnectionError("no cluster node returned a full slot map (" + "; ".join(errors) + ")")

    def nodes(self) -> list[Address]:
        """Every server this client routes to (all masters in cluster mode)."""
        if not self._config.cluster:
            return list(self._seeds)
        slot_map = self._slot_map or self._refresh_slots()
        return list(dict.fromkeys(slot_map))

    # -- execution -------------------------------------------------------------
    def run(
        self, slot: int, step: Callable[[Connection], T], *, what: str, key: str, deadline: float | None = None, retries: int | None = None
    ) -> T:
        """Run ``step`` on a connection to the server owning ``slot``, retrying transient failures.

        ``step`` must be safe to run again after a failure (the callers keep
        progress in a state object). ``deadline`` (monotonic) cuts retries short;
        ``retries`` overrides ``retry_attempts``. Once the client is closed
        nothing is retried: :class:`~omni_plugins.errors.ConnectorClosedError`.
        """
        cfg = self._config
        max_attempts = cfg.retry_attempts if retries is None else retries
        delay = cfg.retry_backoff
        attempt = 0
        while True:
            address: Address | str = self.label
            try:
                address = self._address_for(slot)
                return self._pool(address).use(step)
            except AuthError:
                raise
            except ConnectorClosedError as exc:
                raise ConnectorClosedError(f"{what} {key!r}: {exc}") from None
            except ReplyError as exc:
                if exc.code in _AUTH_REPLIES:
                    raise AuthError(f"{what} {key!r} on Redis {address}: {exc} (ACL user lacks a permission or key pattern)") from None
                if exc.code not in _RETRYABLE_REPLIES:
                    raise ConnectorError(f"{what} {key!r} on Redis {address}: {exc}") from None
                failure: BaseException = exc
            except ConnectorError:
                raise
            except OSError as exc:  # ConnectionError, socket.timeout, ssl errors, ProtocolError
                failure = exc
            if self._closed.is_set():  # close() aborted the call, or the server failed meanwhile: no retry
                raise ConnectorClosedError(
                    f"{what} {key!r} on Redis {address}: the connector was closed ({type(failure).__name__}: {failure})"
                ) from None
            if self._config.cluster:
                self._slot_map = None
            attempt += 1
            now = time.monotonic()
            if attempt > max_attempts or (deadline is not None and now + delay > deadline):
                raise ConnectorError(
                    f"{what} {key!r} on Redis {address} failed after {attempt} attempt(s): {type(failure).__name__}: {failure}"
                ) from None
            if isinstance(failure, ReplyError) and failure.code == "MOVED" and attempt == 1:
                continue  # slot moved: the refreshed map routes the retry right away
            log.debug("%s %r on Redis %s: %s; retry %d in %.2fs", what, key, address, failure, attempt, delay)
            if self._closed.wait(delay):
                raise ConnectorClosedError(f"{what} {key!r} on Redis {address}: the connector was closed") from None
            delay = min(delay * 2, cfg.retry_backoff_max)

    def run_on(self, address: Address, step: Callable[[Connection], T], *, what: str) -> T:
        """Run ``step`` once on a given server (no retry); for health checks."""
        try:
            return self._pool(address).use(step)
        except (OSError, ReplyError) as exc:
            raise ConnectorError(f"{what} on Redis {address}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """Close every pool: calls in flight fail at once (their connections are aborted), none start or retry.

        Deferred deletes of idle connections are sent; their replies are
        awaited for at most ``CLOSE_SETTLE_S`` in all.
        """
        with self._lock:
            self._closed.set()
            pools = list(self._pools.values())
        deadline = time.monotonic() + min(CLOSE_SETTLE_S, self._config.socket_timeout)
        for pool in pools:
            pool.close(deadline)


def _parse_cluster_slots(reply: Reply, asked: Address) -> list[Address] | None:
    if not isinstance(reply, list):
        return None
    slot_map: list[Address | None] = [None] * SLOTS
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3 or not isinstance(entry[2], list):
            continue
        start, end, master = entry[0], entry[1], entry[2]
        if not isinstance(start, int) or not isinstance(end, int) or len(master) < 2:
            continue
        host = master[0].decode() if isinstance(master[0], bytes) else ""
        port = master[1] if isinstance(master[1], int) else 0
        address = Address(host=host or asked.host, port=port)
        for slot in range(max(start, 0), min(end, SLOTS - 1) + 1):
            slot_map[slot] = address
    if any(a is None for a in slot_map):
        return None
    return [a for a in slot_map if a is not None]


__all__ = ["Address", "AuthError", "Connection", "NodePool", "ProtocolError", "RedisClient"]
