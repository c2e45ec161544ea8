"""One step of a put or get on a pooled redis-py connection, retried across restarts and failovers.

:meth:`RedisClient.run` routes a step to the server owning its slot
(:mod:`.topology`), lends it a pooled connection as a :class:`Link`, and
retries it with redis-py's ``Retry`` after connection failures, ``LOADING``,
cluster redirects and ``READONLY`` (a demoted primary), backing off with
redis-py's ``EqualJitterBackoff``; the final failure becomes a
:class:`~omni_plugins.errors.ConnectorError` naming the server and the key.
Steps keep their progress in a state object, so a retry resumes.

Small cleanup commands (a commit marker's ``DEL``, a claim list's
``UNLINK``, a consumed payload's parts) wait in the server's
:class:`~.cleanup.NodeQueue` and ride along with the next write to that server: no
extra round trip or system call. A failed step hands its share back; after a
cluster node failed, its queue is re-routed by slot to whoever serves it now.
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
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    NoPermissionError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from omni_plugins.errors import ConnectorClosedError, ConnectorError
from omni_plugins_redis.cleanup import Deferred
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.connection import OmniConnection
from omni_plugins_redis.packing import Arg, Buffer, pack_many
from omni_plugins_redis.replies import ProtocolError, Reply, ReplyReader
from omni_plugins_redis.topology import Route, Topology, build

log = logging.getLogger(__name__)

#: SO_LINGER on with a zero timeout: close() resets the connection, dropping unsent data
_LINGER_RESET = struct.pack("ii", 1, 0)

T = TypeVar("T")
# How long close() waits, in all, for the replies of deferred commands it sends (a stalled server must not hold it up).
CLOSE_SETTLE_S = 2.0
# Error replies after which the same step may succeed later: redirects, failover, replicas, loading.
# UNBLOCKED: a blocked BLMOVE released because its primary became a replica (a failover)
_RETRY_CODES = frozenset({"LOADING", "BUSY", "NOREPLICAS", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "READONLY", "UNBLOCKED"})
_RETRY_REPLIES = (AskError, ClusterDownError, TryAgainError, ReadOnlyError)
# Error replies that mean the server is no longer what it was (a failover): its connections are dropped.
_SERVER_CHANGED = frozenset({"READONLY", "UNBLOCKED", "MASTERDOWN", "LOADING"})


class AuthError(ConnectorError):
    """The server rejected our credentials or the ACL user lacks a permission (not retried)."""


def _reset_on_close(conn: Any) -> None:
    """Make the connection's close abortive (RST), dropping whatever the kernel still holds to send.

    A connection whose call failed half-way may still hold a command the server has not
    received (a partition: the kernel keeps retransmitting it). Closed gracefully, that
    command could reach the server after the heal -- after a retry on a new connection
    already ran it once (a commit twice: a duplicate payload). Reset, it never arrives.
    """
    sock = getattr(conn, "_sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)


class Link:
    """A pooled redis-py connection lent to one step, with its server's deferred cleanup riding on the first write.

    Commands go out through redis-py's ``send_packed_command`` (framed by
    :mod:`.packing`); replies are read by the connection's
    :class:`~.replies.ReplyReader`, bulk bodies straight into caller memory.

    :meth:`abort` (from another thread, when the client closes) makes a call
    blocked on the socket fail at once; the owner may then queue last commands
    behind what it sent (:meth:`send_last`).
    """

    __slots__ = ("_in_flight", "_reader", "_sending", "_write_shut", "aborted", "client", "conn", "queue", "route")

    def __init__(self, client: RedisClient, conn: OmniConnection, route: Route) -> None:
        self.client = client
        self.conn = conn
        self.route = route
        self.queue = route.queue
        self.aborted = False
        self._in_flight: list[Deferred] = []  # deferred commands sent on this link, replies not read yet
        self._reader: ReplyReader | None = None
        self._sending = False
        self._write_shut = False

    # -- sending -------------------------------------------------------------
    def send(self, commands: Sequence[Sequence[Arg]]) -> None:
        """Send commands in one write (large values straight from their buffers), after any deferred cleanup."""
        self.send_frames(pack_many(commands))

    def send_frame(self, frame: bytes) -> None:
        """Send one framed ``bytes`` (the hot path of small puts and gets)."""
        self.send_frames([frame])

    def send_frames(self, frames: list[Buffer]) -> None:
        if self.queue.pending:
            taken = self.queue.take_all()
            self._in_flight += taken
            head = b"".join(d.frame for d in taken)
            # one write, one segment: the server reads cleanup and command together
            frames = [head + frames[0], *frames[1:]] if frames and isinstance(frames[0], bytes) else [head, *frames]
        self._sending = True  # before the check: abort() either sees it (and stops the send) or is seen here
        try:
            if self.aborted:
                raise ConnectionAbortedError(f"connection to Redis {self.route.name} aborted (the client is closing)")
            self.conn.send_packed_command(frames, check_health=False)
        except BaseException:
            self._write_shut = True  # a command may have gone out cut short
            raise
        finally:
            self._sending = False

    def defer(self, slot: int, *args: Arg, frame: bytes | None = None, flush: bool = False) -> None:
        """Queue an idempotent cleanup command for the next write to this server (errors are logged, not raised).

        ``flush`` (or ``lazy_cleanup: false``) sends it, and whatever else waits,
        now and reads the replies (one round trip).
        """
        self.queue.add([Deferred(slot, args, frame if frame is not None else b"".join(pack_many([args])))])
        if flush or not self.client.lazy_cleanup:
            self.send_frames([])
            self.settle()

    def retire(self, slot: int, keys: Sequence[bytes]) -> None:
        """Leave a consumed payload's parts for the next parted put to this server (see :class:`~.cleanup.NodeQueue`)."""
        self.queue.retire(slot, keys)

    def take_retired(self) -> list[bytes]:
        """The retired parts waiting for this server, now the caller's to delete."""
        return [key for _, group in self.queue.take_retired() for key in group]

    # -- reading ---------------------------------------------------------------
    def _reply_reader(self) -> ReplyReader:
        reader = self._reader
        if reader is None:
            reader = self._reader = self.conn.reader()
        if self._in_flight:
            self._settle_deferred(reader)
        return reader

    def read(self) -> Reply:
        """The next reply; an error reply is returned (a redis-py exception instance), a lost connection raised."""
        found = self._reply_reader().reply()
        if isinstance(found, redis.ConnectionError):  # e.g. LOADING, NOAUTH: as redis-py's parser raises them
            raise found
        return found

    def read_pair(self, timeout: float | None = None) -> tuple[Reply, Reply]:
        """The next two replies: a bulk string and an integer parsed in one step (see :meth:`.ReplyReader.bulk_and_integer`).

        ``timeout`` bounds this read instead of the socket timeout (a blocking command).
        """
        reader = self._reply_reader()
        if timeout is None:
            first, second = reader.bulk_and_integer()
        else:
            reader.set_timeout(timeout)
            try:
                first, second = reader.bulk_and_integer()
            finally:
                with contextlib.suppress(OSError):
                    reader.set_timeout(None)
        for found in (first, second):
            if isinstance(found, redis.ConnectionError):
                raise found
        return first, second

    def read_many(self, count: int) -> list[Reply]:
        return [self.read() for _ in range(count)]

    def expect(self, pattern: re.Pattern[bytes]) -> re.Match[bytes] | None:
        """Consume the next replies if they match ``pattern`` (see :meth:`.ReplyReader.match`); None: read them one by one."""
        return self._reply_reader().match(pattern)

    def call(self, *args: Arg) -> Reply:
        """One command, one reply; raises an error reply."""
        self.send([args])
        reply = self.read()
        if isinstance(reply, RedisError):
            raise reply
        return reply

    def bulk_size(self) -> int:
        """The size of the next bulk reply (-1: nil), its body left for :meth:`body_into`."""
        return self._reply_reader().bulk_size()

    def body_into(self, dest: memoryview) -> None:
        self._reply_reader().body_into(dest)

    def bulk_into(self, dest: memoryview) -> bool:
        """Read a bulk reply of exactly ``len(dest)`` bytes into ``dest``; False for nil."""
        reader = self._reply_reader()
        size = reader.bulk_size()
        if size < 0:
            return False
        if size != dest.nbytes:
            raise ProtocolError(f"stored part is {size} bytes, manifest says {dest.nbytes}")
        reader.body_into(dest)
        return True

    # -- deferred replies ---------------------------------------------------------
    def settle(self) -> None:
        """Read the replies of deferred commands sent and not read yet."""
        if self._in_flight:
            self._reply_reader()

    def _settle_deferred(self, reader: ReplyReader) -> None:
        """Read the replies of the deferred commands sent before this step's own (they come first)."""
        items = self._in_flight
        if reader.skip_integers(len(items)):  # the usual case: every delete answered with a count
            self._in_flight = []
            return
        self._in_flight = []
        for index, item in enumerate(items):
            try:
                found = reader.reply()
            except BaseException:
                self._in_flight = items[index:]  # not known to have run: handed back when the link is dropped
                raise
            if isinstance(found, RedisError):
                if retryable(found):  # e.g. MOVED after a failover: send again where the slot lives now
                    self.client.orphan([item])
                else:
                    log.warning("Redis %s: deferred %s failed: %s", self.route.name, item.args[0], found)

    def take_in_flight(self) -> list[Deferred]:
        items, self._in_flight = self._in_flight, []
        return items

    @property
    def clean(self) -> bool:
        """Every reply read: the connection can serve the next step."""
        return not self._in_flight and (self._reader is None or not self._reader.buffered)

    # -- close() ---------------------------------------------------------------
    def abort(self) -> None:
        """Make the call blocked on this link fail now (thread-safe; the client is closing).

        Shuts the receive side down (a blocked read ends at once), and the send
        side too if a send is under way. The socket stays open for the owner,
        which may still queue commands with :meth:`send_last`.
        """
        self.aborted = True
        sock = self.conn._sock
        if sock is None:
            return
        how = socket.SHUT_RDWR if self._sending else socket.SHUT_RD
        if how == socket.SHUT_RDWR:
            self._write_shut = True
        with contextlib.suppress(OSError, ValueError):
            socket.socket.shutdown(sock, how)  # the plain socket's: an SSLSocket's own would unwrap it

    def send_last(self, commands: Sequence[Sequence[Arg]]) -> bool:
        """After :meth:`abort`: queue ``commands`` behind everything sent, end the stream, wait for nothing.

        The server runs them after what it already received from this
        connection, even one that is stalled now and resumes later (e.g. to
        withdraw a put whose commit may still be executed). Never blocks: False
        when they could not all be queued (send side shut, TLS, full buffer).
        """
        sock = self.conn._sock
        if self._write_shut or sock is None or isinstance(sock, ssl.SSLSocket):
            return False
        self._write_shut = True
        data = memoryview(b"".join(bytes(b) for b in pack_many(commands)))
        sent = 0
        try:
            while sent < len(data):
                sent += sock.send(data[sent:], socket.MSG_DONTWAIT)
        except OSError as exc:
            log.debug("Redis %s: last commands not queued (%s)", self.route.name, exc)
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_WR)
        return sent == len(data)


def retryable(error: BaseException) -> bool:
    """Whether the same step may succeed on a later attempt (after a backoff, maybe elsewhere)."""
    if isinstance(error, AuthenticationError | AuthorizationError | NoPermissionError):
        return False
    if isinstance(error, ResponseError):
        return isinstance(error, _RETRY_REPLIES) or _code(error) in _RETRY_CODES
    return isinstance(error, RedisError | OSError)


def _code(error: BaseException) -> str:
    """The error code of a reply (``NOPERM``, ``MOVED``...), as redis-py recorded it."""
    return getattr(error, "status_code", None) or ""


class _Attempts:
    """One run's progress across attempts (what the failure hook needs)."""

    __slots__ = ("count", "route")

    def __init__(self) -> None:
        self.count = 0
        self.route: Route | None = None


class RedisClient:
    """Routes each step to the right server and retries it; one instance per connector."""

    def __init__(self, config: RedisConfig) -> None:
        self._config = config
        self.topology: Topology = build(config)
        self.label = self.topology.label
        self.lazy_cleanup = config.lazy_cleanup
        self._closed = threading.Event()
        self._busy: set[Link] = set()  # (set.add/discard and list(set) are atomic: no lock on the hot path)
        self._lock = threading.Lock()
        self._orphans: list[Deferred] = []
        self._backoff = EqualJitterBackoff(cap=config.retry_backoff_max, base=config.retry_backoff / 2)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def orphan(self, items: Sequence[Deferred]) -> None:
        """Cleanup commands whose server is gone or moved: sent, by slot, with a later write wherever the slot lives."""
        with self._lock:
            self._orphans.extend(items)

    def _place_orphans(self) -> None:
        with self._lock:
            items, self._orphans = self._orphans, []
        for index, item in enumerate(items):
            try:
                route = self.topology.route(item.slot)
            except (RedisError, OSError):
                self.orphan(items[index:])
                return
            route.queue.add([item])

    # -- execution -------------------------------------------------------------
    def run(
        self, slot: int, step: Callable[[Link], T], *, what: str, key: str, deadline: float | None = None, retries: int | None = None
    ) -> T:
        """Run ``step`` on a connection to the server owning ``slot``, retrying transient failures.

        ``step`` must be safe to run again after a failure (the callers keep
        progress in a state object). ``deadline`` (monotonic) cuts retries short;
        ``retries`` overrides ``retry_attempts``. Once the client is closed
        nothing is retried: :class:`~omni_plugins.errors.ConnectorClosedError`.
        """
        attempts = _Attempts()
        max_attempts = self._config.retry_attempts if retries is None else retries
        try:
            try:
                return self._attempt(slot, step, attempts)  # the usual case, without the retry machinery
            except (RedisError, OSError) as exc:
                if not retryable(exc) or max_attempts == 0:
                    raise
                self._after_failure(exc, 1, max_attempts, deadline)
            retry = Retry(NoBackoff(), max_attempts - 1, supported_errors=(RedisError, OSError), is_retryable=retryable)
            return retry.call_with_retry(
                lambda: self._attempt(slot, step, attempts),
                lambda error, failures: self._after_failure(error, failures + 1, max_attempts, deadline),
                with_failure_count=True,
            )
        except ConnectorClosedError as exc:
            raise ConnectorClosedError(f"{what} {key!r}: {exc}") from None
        except (RedisError, OSError, _OutOfTime) as exc:
            raise self._error(exc, what, key, attempts) from None

    def _attempt(self, slot: int, step: Callable[[Link], T], attempts: _Attempts) -> T:
        attempts.count += 1
        if self._closed.is_set():
            raise ConnectorClosedError(f"Redis {self.label}: the client is closed")
        if self._orphans:
            self._place_orphans()
        attempts.route = None
        try:
            route = self.topology.route(slot)
        except (RedisError, OSError) as exc:
            self.topology.failed(None, exc)
            raise
        attempts.route = route
        return self._use(route, step)

    def _use(self, route: Route, step: Callable[[Link], T]) -> T:
        """Run ``step`` on a connection of ``route``'s pool.

        A connection that served a step well is kept checked out, in a list of
        this client's, for the next step: redis-py's ``get_connection`` and
        ``release`` cost 25-30 µs of CPU per 4 KiB put+get pair here (a
        readiness ``poll()`` and metrics on each), about a quarter of the pair.
        The pool still makes every connection, bounds how many there are
        (``pool_size``), takes back each that failed (it reconnects on its next
        checkout) and gets all back at close.
        """
        kept = route.kept
        try:
            conn: OmniConnection = kept.pop()
        except IndexError:
            try:
                conn = route.pool.get_connection()  # type: ignore[assignment]  # the topology's connection class
            except (RedisError, OSError) as exc:
                if self.topology.failed(route, exc):
                    self.orphan(route.queue.take_all())
                raise
        link = Link(self, conn, route)
        self._busy.add(link)
        if self._closed.is_set():  # close() ran since _attempt looked: its snapshot of _busy may lack this link
            self._busy.discard(link)
            route.pool.release(conn)
            raise ConnectorClosedError(f"Redis {self.label}: the client is closed")
        try:
            result = step(link)
            if link._in_flight:
                link.settle()
        except BaseException as exc:
            self._busy.discard(link)
            self._drop(link, exc)
            raise
        self._busy.discard(link)
        if not link.clean or self._closed.is_set():  # bytes beyond the last reply: the stream is out of step
            conn.disconnect()
            route.pool.release(conn)
        else:
            kept.append(conn)
        return result

    def _drop(self, link: Link, error: BaseException) -> None:
        """After a failed step: hand its deferred commands back, never reuse its connection as it is."""
        items = link.take_in_flight()
        gone = self.topology.failed(link.route, error)
        if gone:  # the server may be gone for good (cluster failover): re-route everything waiting for it by slot
            self.orphan([*items, *link.queue.take_all()])
        elif items:
            link.queue.add(items)
        if not link.aborted:  # (after close() aborted it, what it queued behind the call -- a withdrawal -- must go out)
            _reset_on_close(link.conn)
        link.conn.disconnect()  # state unknown (half-read reply?): reconnect before the next use
        link.route.pool.release(link.conn)
        if isinstance(error, OSError | redis.ConnectionError | redis.TimeoutError) or _code(error) in _SERVER_CHANGED:
            self._flush_kept(link.route)  # the server died or changed role: its other connections are stale too

    @staticmethod
    def _flush_kept(route: Route) -> None:
        """Give ``route``'s kept connections back, disconnected (each reconnects, via Sentinel too, on its next checkout)."""
        while route.kept:
            try:
                conn = route.kept.pop()
            except IndexError:
                return
            conn.disconnect()
            route.pool.release(conn)

    def _after_failure(self, error: Exception, failures: int, max_attempts: int, deadline: float | None) -> None:
        """Retry's failure hook (the topology already heard of the failure): stop when closed or out of time, wait the backoff."""
        if self._closed.is_set():
            raise ConnectorClosedError(f"Redis {self.label}: the connector was closed ({type(error).__name__}: {error})") from None
        if not retryable(error) or failures > max_attempts:
            return
        delay = 0.0 if (failures == 1 and _code(error) == "MOVED") else self._backoff.compute(failures)
        if deadline is not None and time.monotonic() + delay > deadline:
            raise _OutOfTime(error)
        log.debug("Redis %s: %s; retry %d in %.2fs", self.label, error, failures, delay)
        if delay and self._closed.wait(delay):
            raise ConnectorClosedError(f"Redis {self.label}: the connector was closed") from None

    def _error(self, exc: BaseException, what: str, key: str, attempts: _Attempts) -> ConnectorError:
        """The ConnectorError a failed run raises: server, key and the reason; never a password."""
        if isinstance(exc, _OutOfTime):
            exc = exc.error
        where = attempts.route.name if attempts.route is not None else self.label
        if isinstance(exc, AuthenticationError):
            code = _code(exc) or "AUTH"
            if self._config.credential_provider:
                return AuthError(f"Redis {where} rejected the user of credential_provider: {code} {exc} (check its credentials)")
            user = self._config.username or "default"
            return AuthError(f"Redis {where} rejected user {user!r}: {code} {exc} (check username/password)")
        if isinstance(exc, NoPermissionError | AuthorizationError):
            return AuthError(f"{what} {key!r} on Redis {where}: NOPERM {exc} (ACL user lacks a permission or key pattern)")
        if isinstance(exc, ResponseError) and not retryable(exc):
            return ConnectorError(f"{what} {key!r} on Redis {where}: {_code(exc)} {exc}".replace("  ", " "))
        return ConnectorError(f"{what} {key!r} on Redis {where} failed after {attempts.count} attempt(s): {type(exc).__name__}: {exc}")

    def run_on(self, route: Route, step: Callable[[Link], T], *, what: str) -> T:
        """Run ``step`` once on a given server (no retry); for health checks."""
        try:
            return self._use(route, step)
        except (RedisError, OSError) as exc:
            raise ConnectorError(f"{what} on Redis {route.name}: {type(exc).__name__}: {exc}") from None

    def primaries(self) -> list[Route]:
        """Every server this client writes to (all primaries of a cluster)."""
        try:
            return self.topology.primaries()
        except (RedisError, OSError) as exc:
            raise ConnectorError(f"Redis {self.label}: {type(exc).__name__}: {exc}") from None

    # -- close -------------------------------------------------------------------
    def close(self, *, wait_replicas: tuple[int, int] | None = None) -> None:
        """Close: calls in flight fail at once (their sockets are shut down), none start or retry.

        Deferred cleanup still waiting is sent on a connection of its own per
        server; its replies (and, with ``wait_replicas`` ``(n, ms)``, the
        replicas' acknowledgement) are awaited for at most ``CLOSE_SETTLE_S`` in all.
        """
        with self._lock:
            self._closed.set()
            busy = list(self._busy)
            orphans, self._orphans = self._orphans, []
        for link in busy:
            link.abort()
        for route in self.topology.routes():
            while route.kept:
                route.pool.release(route.kept.pop())
        deadline = time.monotonic() + min(CLOSE_SETTLE_S, self._config.socket_timeout)
        pending: dict[str, tuple[Route, list[Deferred]]] = {}
        for item in orphans:
            with contextlib.suppress(RedisError, OSError):
                found = self.topology.route(item.slot)
                pending.setdefault(found.name, (found, []))[1].append(item)
        for route in self.topology.routes():
            if route.queue.pending:
                pending.setdefault(route.name, (route, []))[1].extend(route.queue.take_all())
        for route, items in pending.values():
            self._settle_at_close(route, items, deadline, wait_replicas)
        with contextlib.suppress(RedisError, OSError):
            self.topology.close()

    @staticmethod
    def _settle_at_close(route: Route, items: list[Deferred], deadline: float, wait_replicas: tuple[int, int] | None) -> None:
        """Send ``items`` on a connection of their own (the pool may be busy) and wait for the replies until ``deadline``."""
        pool = route.pool
        conn = pool.connection_class(**pool.connection_kwargs)
        frames: list[Buffer] = [item.frame for item in items]
        count = len(items)
        if wait_replicas is not None:
            frames += pack_many([("WAIT", *wait_replicas)])
            count += 1
        try:
            conn.connect()
            conn._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            conn.send_packed_command(frames, check_health=False)
            for _ in range(count):
                with contextlib.suppress(ResponseError):
                    conn.read_response()
        except (RedisError, OSError) as exc:
            log.debug("Redis %s: deferred cleanup not confirmed at close: %s (keys expire by TTL)", route.name, exc)
        finally:
            conn.disconnect()


class _OutOfTime(Exception):
    """The caller's deadline leaves no room for another attempt."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


__all__ = ["AuthError", "Link", "ProtocolError", "RedisClient", "retryable"]
