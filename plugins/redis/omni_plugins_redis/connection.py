"""redis-py's connection classes with two measured additions: kernel-kept socket timeouts and a reply reader.

**Socket timeouts kept by the kernel.** A Python socket with ``settimeout(t)``
calls ``poll()`` before every send and every receive: two extra system calls
per round trip (here 4 µs of CPU and ~20 µs of latency on a 4 KiB get). After
redis-py connected a plain TCP or unix socket, it is made blocking with
``SO_RCVTIMEO``/``SO_SNDTIMEO`` set to ``socket_timeout``: it waits inside
``recv``/``send`` themselves and still never waits forever (a call that runs
out of time fails with ``EAGAIN``, which redis-py reports as a
``ConnectionError`` and the reader as a ``TimeoutError``; both are retried).
TLS sockets keep Python's timeouts (the ``ssl`` module expects them).

**One reply reader per socket** (:mod:`.replies`), reused by every step on
the connection, so a step allocates no receive buffer.

Everything else -- connecting, TLS, AUTH/HELLO, credential providers,
``SELECT``, Sentinel's primary discovery -- is redis-py's own code (discovery
follows the newest configuration the Sentinels name: :mod:`.sentinel`).
"""

from __future__ import annotations

import functools
import socket
import struct
from typing import Any

from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from omni_plugins_redis.replies import ReplyReader

_TIMEVAL = struct.Struct("@ll")


def _timeval(seconds: float) -> bytes:
    # 0 would mean "no timeout": every bound is at least one microsecond
    micros = max(1, round(seconds * 1_000_000))
    return _TIMEVAL.pack(*divmod(micros, 1_000_000))


def use_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking, with every send and receive bounded by ``seconds`` in the kernel."""
    sock.settimeout(None)
    value = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def set_receive_timeout(sock: socket.socket, seconds: float) -> None:
    """Change the kernel's receive bound of a socket set up by :func:`use_kernel_timeouts`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


class _ReaderMixin:
    """What the connector adds to a redis-py connection: the reply reader of its current socket."""

    _sock: Any
    socket_timeout: float | None
    _omni_reader: ReplyReader | None = None
    _kernel_timeouts = False

    def reader(self) -> ReplyReader:
        """The reply reader of the current socket (a new one after a reconnect)."""
        reader = self._omni_reader
        sock = self._sock
        if reader is None or reader.sock is not sock:
            if sock is None:
                raise RedisConnectionError("the connection is closed")
            timeout = self.socket_timeout or _NO_TIMEOUT
            set_timeout = functools.partial(set_receive_timeout, sock) if self._kernel_timeouts else sock.settimeout
            reader = self._omni_reader = ReplyReader(sock, set_timeout, timeout)
        return reader


_NO_TIMEOUT = 3600.0


class _KernelTimeoutsMixin(_ReaderMixin):
    _kernel_timeouts = True

    def _connect(self) -> socket.socket:
        sock: socket.socket = super()._connect()  # type: ignore[misc]
        use_kernel_timeouts(sock, self.socket_timeout or _NO_TIMEOUT)
        return sock


class OmniConnection(_KernelTimeoutsMixin, Connection):  # the interface every connection class here offers
    """TCP connection (redis-py's) with kernel-kept timeouts and the connector's reply reader."""


class OmniUnixConnection(_KernelTimeoutsMixin, UnixDomainSocketConnection):
    """Unix socket connection (redis-py's) with kernel-kept timeouts and the connector's reply reader."""


class OmniSSLConnection(_ReaderMixin, SSLConnection):
    """TLS connection (redis-py's) with the connector's reply reader; Python keeps its timeouts."""


class OmniSentinelConnection(_KernelTimeoutsMixin, SentinelManagedConnection):
    """Connection to the primary a Sentinel names (redis-py's), with kernel-kept timeouts and the reply reader."""


class OmniSentinelSSLConnection(_ReaderMixin, SentinelManagedSSLConnection):
    """TLS connection to the primary a Sentinel names (redis-py's), with the reply reader."""
