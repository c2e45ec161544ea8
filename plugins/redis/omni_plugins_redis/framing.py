"""Hand-built RESP2 framing: vectored writes of big values and reads into caller memory.

Why not redis-py's packer: hiredis's packer copies every memoryview into
bytes first and spends most of a 64 MiB ``SET`` doing so (see
``shared/docs/backends.md``). Here a command is a list of buffers: the small
framing is joined into one ``bytes`` and each large value buffer is passed
through untouched to ``sendmsg`` (one kernel copy, no Python copy).

On the read side :class:`ReplyReader` parses ordinary replies from a small
buffer, and :meth:`ReplyReader.read_bulk_into` streams a bulk string straight
into a slice of the caller's preallocated payload buffer.
"""

from __future__ import annotations

import re
import socket
import ssl
from collections.abc import Iterable, Sequence
from typing import Union

# Buffers at least this large are sent as their own iovec instead of being joined.
_BIG = 32 * 1024
_IOV_MAX = 1024
_READ_CHUNK = 64 * 1024


class ProtocolError(ConnectionError):
    """The byte stream from the server is not valid RESP; the connection is unusable."""


class ReplyError(Exception):
    """An error reply (``-ERR ...``) from the server."""

    @property
    def code(self) -> str:
        """The first word of the error, e.g. ``NOPERM``, ``MOVED``, ``WRONGPASS``."""
        text = str(self)
        return text.split(" ", 1)[0] if text else ""


Buffer = bytes | bytearray | memoryview


class Pieces:
    """One bulk argument made of several buffers (a part spanning encoder buffers)."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self.buffers = [as_bytes_view(b) for b in buffers]
        self.nbytes = sum(b.nbytes for b in self.buffers)


Arg = bytes | str | int | float | memoryview | Pieces
Reply = Union[None, int, bytes, bytearray, str, ReplyError, list["Reply"]]  # noqa: UP007 (recursive alias)


def as_bytes_view(buf: Buffer) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def pack(*args: Arg) -> list[Buffer]:
    """Frame one command; returns buffers whose concatenation is the RESP bytes."""
    return pack_many([args])


_TOKENS: dict[str, bytes] = {}


def _token(text: str) -> bytes:
    """RESP bulk encoding of a short string argument (command names, options), cached."""
    framed = _TOKENS.get(text)
    if framed is None:
        data = text.encode()
        framed = b"$%d\r\n%b\r\n" % (len(data), data)
        if len(_TOKENS) < 256:
            _TOKENS[text] = framed
    return framed


def pack_many(commands: Iterable[Sequence[Arg]]) -> list[Buffer]:
    """Frame a pipeline of commands; small pieces are joined, big value buffers passed through."""
    out: list[Buffer] = []
    parts: list[bytes | memoryview] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, bytes):
                parts.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
            elif isinstance(arg, str):
                parts.append(_token(arg) if len(arg) <= 16 else b"$%d\r\n%b\r\n" % (len(arg.encode()), arg.encode()))
            elif isinstance(arg, int | float):
                data = repr(arg).encode()
                parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
            else:
                views = arg.buffers if isinstance(arg, Pieces) else [as_bytes_view(arg)]
                parts.append(b"$%d\r\n" % sum(v.nbytes for v in views))
                for view in views:
                    if view.nbytes >= _BIG:
                        if parts:
                            out.append(b"".join(parts))
                            parts = []
                        out.append(view)
                    else:
                        parts.append(view)
                parts.append(b"\r\n")
    if parts:
        out.append(b"".join(parts))
    return out


def send_buffers(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """Write all buffers; vectored (``sendmsg``) on plain sockets, ``sendall`` each under TLS."""
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [as_bytes_view(b) for b in buffers if len(b)]
    start = 0
    while start < len(views):
        sent = sock.sendmsg(views[start : start + _IOV_MAX])
        while sent:
            size = views[start].nbytes
            if sent >= size:
                sent -= size
                start += 1
            else:
                views[start] = views[start][sent:]
                sent = 0


class ReplyReader:
    """Parses RESP2 replies from a socket, with a zero-extra-copy path for large bulk strings."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._pos = 0
        self._scratch = bytearray(_READ_CHUNK)

    def _fill(self) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        n = self._sock.recv_into(self._scratch)
        if n == 0:
            raise ConnectionError("server closed the connection")
        self._buf += memoryview(self._scratch)[:n]

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                if not line:
                    raise ProtocolError("empty RESP line")
                return line
            self._fill()

    def _exact(self, n: int) -> bytes | bytearray:
        """A bulk string body: ``bytes`` when small, a fresh writable ``bytearray`` (read in place) when large."""
        if n >= _READ_CHUNK:
            data = bytearray(n)
            self._read_into(memoryview(data))
            return data
        while len(self._buf) - self._pos < n + 2:
            self._fill()
        small = bytes(self._buf[self._pos : self._pos + n])
        if self._buf[self._pos + n : self._pos + n + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self._pos += n + 2
        return small

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the buffer, then straight from the socket; consume the CRLF."""
        n = dest.nbytes
        have = min(len(self._buf) - self._pos, n)
        if have:
            dest[:have] = self._buf[self._pos : self._pos + have]
            self._pos += have
        offset = have
        while offset < n:
            got = self._sock.recv_into(dest[offset:])
            if got == 0:
                raise ConnectionError("server closed the connection mid-value")
            offset += got
        while len(self._buf) - self._pos < 2:
            self._fill()
        if self._buf[self._pos : self._pos + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self._pos += 2

    def skip(self, expected: re.Pattern[bytes]) -> bool:
        """Consume the next replies if the bytes already received match ``expected`` (fast path).

        False (nothing consumed) when they do not, or have not all arrived yet: the
        caller then parses them one by one with :meth:`read`.
        """
        if self._pos == len(self._buf):
            self._fill()
        found = expected.match(self._buf, self._pos)
        if found is None:
            return False
        self._pos = found.end()
        return True

    def read(self) -> Reply:
        """Read one reply. Error replies are *returned* as :class:`ReplyError` (callers raise)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode("utf-8", "replace")
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", "replace"))
        if kind == b":":
            return _int(rest)
        if kind == b"$":
            n = _int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = _int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise ProtocolError(f"unexpected RESP type byte {kind!r}")

    def read_bulk_into(self, dest: memoryview) -> bool:
        """Read a bulk-string reply of exactly ``len(dest)`` bytes into ``dest``.

        Returns False for a nil reply. Raises :class:`ReplyError` for an error
        reply and :class:`ProtocolError` when the size differs (the stream is
        then out of step and the connection must be dropped).
        """
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise ReplyError(rest.decode("utf-8", "replace"))
        if kind != b"$":
            raise ProtocolError(f"expected a bulk string, got type byte {kind!r}")
        n = _int(rest)
        if n < 0:
            return False
        if n != dest.nbytes:
            raise ProtocolError(f"stored part is {n} bytes, manifest says {dest.nbytes}")
        self._read_into(dest)
        return True


def _int(text: bytes) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"bad RESP integer {text[:32]!r}") from None
