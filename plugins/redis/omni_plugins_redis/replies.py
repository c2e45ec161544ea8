"""Reading the connector's replies straight from the socket, bulk bodies into the caller's memory.

redis-py (hiredis) returns a bulk reply as a new ``bytes``: for a payload part
that is one more copy, and a read-only one, after the kernel's. Here each
part's body goes from the socket into its slice of the one payload buffer the
tensors will own (``recv_into``), and a claimed manifest element into a fresh
writable ``bytearray`` the payload is decoded from in place. Measured: client
CPU of a 64 MiB get 95 -> 32 ms once the buffer was neither copied nor
zero-filled (docs/redis.md).

The connector reads every reply of its own commands here, not only bulk
bodies: the read-into path must own the socket's byte stream, and the small
put and get read 3 to 7 replies each, which redis-py's ``read_response``
(1.5-2.5 µs of Python per reply, docs/redis.md) would make a large part of
their client CPU. The usual answer to a whole batch (a commit transaction,
the deferred deletes' counts) is consumed with one pattern match
(:meth:`ReplyReader.match`). The reader knows only what those commands answer: bulk
strings, integers, status, errors (as redis-py's exception classes), nils and
flat arrays of these (``EXEC``, ``LRANGE``). redis-py's own parser serves
redis-py's own commands (handshake, ``CLUSTER SLOTS``); both start at a reply
boundary, so they never share bytes.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from typing import Any, Union

from redis._parsers import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_READ_CHUNK = 64 * 1024
# Longest line (or small reply) the reader buffers before calling the stream corrupt.
_MAX_LINE = 16 * 1024 * 1024


class ProtocolError(RedisConnectionError):
    """The bytes from the server are not the reply expected; the connection is unusable."""


Reply = Union[int, str, bytearray, RedisError, None, list["Reply"]]  # noqa: UP007 (recursive alias)


class ReplyReader:
    """Parses replies from one socket; bulk bodies are received straight into caller memory.

    Received bytes live in one reusable buffer between ``_pos`` and ``_end``;
    a bulk body is first taken from what the buffer already holds, the rest is
    received directly into the destination.
    """

    def __init__(self, sock: socket.socket, set_timeout: Callable[[float], None], timeout: float) -> None:
        self.sock = sock
        self._set_timeout = set_timeout
        self._timeout = timeout
        self._buf = bytearray(_READ_CHUNK)
        self._pos = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not consumed yet (0 at the end of a batch of replies)."""
        return self._end - self._pos

    def discard(self) -> None:
        """Forget buffered bytes (the connection is being dropped)."""
        self._pos = self._end = 0

    def set_timeout(self, seconds: float | None) -> None:
        """Bound the next receives by ``seconds`` (None: back to the connection's socket timeout)."""
        self._set_timeout(self._timeout if seconds is None else seconds)

    def _recv_into(self, view: memoryview) -> int:
        try:
            n = self.sock.recv_into(view)
        except (TimeoutError, BlockingIOError):  # Python's timeout, or the kernel's (SO_RCVTIMEO: EAGAIN)
            raise RedisTimeoutError("timed out waiting for the server's reply") from None
        except OSError as exc:
            raise RedisConnectionError(f"error while reading from the server: {exc}") from None
        if n == 0:
            raise RedisConnectionError("the server closed the connection")
        return n

    def _fill(self) -> None:
        """Receive more bytes after ``_end``: compact (or grow) the buffer first when its tail is full."""
        buf = self._buf
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(buf):
            if self._pos:
                left = self._end - self._pos
                buf[:left] = buf[self._pos : self._end]
                self._pos, self._end = 0, left
            elif len(buf) >= _MAX_LINE:
                raise ProtocolError(f"RESP line longer than {_MAX_LINE} bytes")
            else:
                buf.extend(bytes(len(buf)))
        self._end += self._recv_into(memoryview(buf)[self._end :])

    def _line(self) -> bytearray:
        while True:
            end = self._buf.find(b"\r\n", self._pos, self._end)
            if end >= 0:
                if end == self._pos:
                    raise ProtocolError("empty RESP line")
                line = self._buf[self._pos : end]
                self._pos = end + 2
                return line
            self._fill()

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the buffer, then straight from the socket; consume the CRLF."""
        n = dest.nbytes
        have = min(self._end - self._pos, n)
        if have:
            dest[:have] = memoryview(self._buf)[self._pos : self._pos + have]
            self._pos += have
        offset = have
        while offset < n:
            offset += self._recv_into(dest[offset:])
        while self._end - self._pos < 2:
            self._fill()
        if self._buf[self._pos : self._pos + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self._pos += 2

    def reply(self) -> Reply:
        """One reply; an error reply is *returned* (a redis-py exception instance, e.g. ``MovedError``)."""
        line = self._line()
        kind = line[0]
        if kind == _BULK:
            n = _int(line[1:])
            if n < 0:
                return None
            body = bytearray(n)  # fresh and writable: decoded in place, owned by the caller
            self._read_into(memoryview(body))
            return body
        if kind == _INTEGER:
            return _int(line[1:])
        if kind == _SIMPLE:
            return line[1:].decode("utf-8", "replace")
        if kind == _ERROR:
            return _error(line)
        if kind == _ARRAY:
            n = _int(line[1:])
            return None if n < 0 else [self.reply() for _ in range(n)]
        if kind == _NULL:  # RESP3
            return None
        raise ProtocolError(f"unexpected RESP type byte {bytes(line[:1])!r}")

    def bulk_size(self) -> int:
        """The length of the next bulk reply (-1: nil); its body must follow with :meth:`body_into`.

        Lets a caller check the size before it allocates the destination. An
        error reply is raised.
        """
        line = self._line()
        kind = line[0]
        if kind == _BULK:
            return _int(line[1:])
        if kind == _NULL:
            return -1
        if kind == _ERROR:
            raise _error(line)
        raise ProtocolError(f"expected a bulk string, got type byte {bytes(line[:1])!r}")

    def body_into(self, dest: memoryview) -> None:
        """The body (and CRLF) of the bulk string whose size :meth:`bulk_size` returned, into ``dest`` of that size."""
        self._read_into(dest)

    def bulk_and_integer(self) -> tuple[Reply, Reply]:
        """Two replies; a bulk string and an integer (a claim's ``LMOVE`` + ``PEXPIRE``) in one step when both arrived.

        The body is copied once, into a writable ``bytearray`` (the payload is
        decoded from it in place). Anything else is read reply by reply.
        """
        if self._pos == self._end:
            self._fill()
        buf = self._buf
        head = _BULK_HEAD.match(buf, self._pos, self._end)
        if head is not None:
            start = head.end()
            stop = start + int(head.group(1))
            tail = _CRLF_INTEGER.match(buf, stop, self._end)
            if tail is not None:
                body = buf[start:stop]
                self._pos = tail.end()
                return body, int(tail.group(1))
        return self.reply(), self.reply()

    def match(self, expected: re.Pattern[bytes]) -> re.Match[bytes] | None:
        """Consume the next replies if the bytes already received match ``expected`` (the usual answer, in one step).

        None (nothing consumed) when they do not, or have not all arrived yet:
        the caller then reads them one by one. The match's groups refer to the
        reader's buffer: read them before the next read.
        """
        if self._pos == self._end:
            self._fill()
        found = expected.match(self._buf, self._pos, self._end)
        if found is not None:
            self._pos = found.end()
        return found

    def skip_integers(self, count: int) -> bool:
        """Consume ``count`` integer replies if they have all arrived (the deferred deletes' usual answers)."""
        pattern = _INTEGERS.get(count)
        return pattern is not None and self.match(pattern) is not None


_SIMPLE, _ERROR, _INTEGER, _BULK, _ARRAY, _NULL = b"+-:$*_"
_BULK_HEAD = re.compile(rb"\$(\d{1,19})\r\n")
_CRLF_INTEGER = re.compile(rb"\r\n:(\d{1,19})\r\n")
# ``count`` integer replies in a row, e.g. ":1\r\n:0\r\n" (the replies of deferred DEL/UNLINKs).
_INTEGERS = {count: re.compile(rb"(?::\d{1,19}\r\n){%d}" % count) for count in range(1, 9)}


def _error(line: bytearray) -> RedisError:
    """The exception redis-py makes of this error reply (its class and ``status_code`` name the error code)."""
    error: Any = BaseParser.parse_error(line[1:].decode("utf-8", "replace"))
    return error if isinstance(error, RedisError) else ResponseError(str(error))


def _int(text: bytes | bytearray) -> int:
    if not 0 < len(text) <= 20 or not (text.isdigit() or (text[0] == 45 and text[1:].isdigit())):
        raise ProtocolError(f"bad RESP integer {bytes(text[:32])!r}")
    return int(text)
