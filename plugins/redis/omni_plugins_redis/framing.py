"""Hand-built RESP2 framing: vectored writes of big values and reads into caller memory.

Why not redis-py's packer: hiredis's packer copies every memoryview into
bytes first and spends most of a 64 MiB ``SET`` doing so. Here a command is a list of buffers: the small
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


def frame_key_command(command: str, key: bytes) -> bytes:
    """RESP framing of a one-key command (``DEL k``, ``UNLINK k``) in one step (what :func:`pack` makes, joined)."""
    return b"*2\r\n%b$%d\r\n%b\r\n" % (_token(command), len(key), key)


def send_buffers(sock: socket.socket, buffers: Sequence[Buffer]) -> None:
    """Write all buffers; vectored (``sendmsg``) on plain sockets, ``sendall`` each under TLS."""
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [as_bytes_view(b) for b in buffers if len(b)]
    start = 0
    while start < len(views):
        try:
            sent = sock.sendmsg(views[start : start + _IOV_MAX])
        except BlockingIOError:  # the kernel's send timeout ran out (see .timeouts)
            raise TimeoutError("timed out sending to the server") from None
        while sent:
            size = views[start].nbytes
            if sent >= size:
                sent -= size
                start += 1
            else:
                views[start] = views[start][sent:]
                sent = 0


class ReplyReader:
    """Parses RESP2 replies from a socket, with a zero-extra-copy path for large bulk strings.

    Received bytes live in one reusable buffer between ``_pos`` (next unread
    byte) and ``_end``; the socket writes straight into its free tail, so a
    small reply costs one ``recv_into`` and no Python-level copy of the buffer.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_READ_CHUNK)
        self._pos = 0
        self._end = 0

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
                raise ProtocolError(f"RESP line or small reply longer than {_MAX_LINE} bytes")
            else:
                buf.extend(bytes(len(buf)))
        try:
            n = self._sock.recv_into(memoryview(buf)[self._end :])
        except BlockingIOError:  # the kernel's receive timeout ran out (see .timeouts)
            raise TimeoutError("timed out waiting for the server's reply") from None
        if n == 0:
            raise ConnectionError("server closed the connection")
        self._end += n

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

    def _exact(self, n: int) -> bytes | bytearray:
        """A bulk string body: ``bytes`` when small, a fresh writable ``bytearray`` (read in place) when large."""
        if n >= _READ_CHUNK:
            data = bytearray(n)
            self._read_into(memoryview(data))
            return data
        while self._end - self._pos < n + 2:
            self._fill()
        pos = self._pos
        if self._buf[pos + n : pos + n + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self._pos = pos + n + 2
        return bytes(memoryview(self._buf)[pos : pos + n])

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` from the buffer, then straight from the socket; consume the CRLF."""
        n = dest.nbytes
        have = min(self._end - self._pos, n)
        if have:
            dest[:have] = memoryview(self._buf)[self._pos : self._pos + have]
            self._pos += have
        offset = have
        while offset < n:
            try:
                got = self._sock.recv_into(dest[offset:])
            except BlockingIOError:
                raise TimeoutError("timed out waiting for the server's reply") from None
            if got == 0:
                raise ConnectionError("server closed the connection mid-value")
            offset += got
        while self._end - self._pos < 2:
            self._fill()
        if self._buf[self._pos : self._pos + 2] != b"\r\n":
            raise ProtocolError("bulk string not terminated by CRLF")
        self._pos += 2

    def skip(self, expected: re.Pattern[bytes]) -> bool:
        """Consume the next replies if the bytes already received match ``expected`` (fast path).

        False (nothing consumed) when they do not, or have not all arrived yet: the
        caller then parses them one by one with :meth:`read`.
        """
        if self._pos == self._end:
            self._fill()
        found = expected.match(self._buf, self._pos, self._end)
        if found is None:
            return False
        self._pos = found.end()
        return True

    def skip_integers(self, count: int) -> bool:
        """Consume ``count`` integer replies if they have all arrived (the deferred deletes' usual answers)."""
        pattern = _INTEGERS.get(count)
        if pattern is None:
            return False
        return self.skip(pattern)

    def read_pair(self) -> tuple[Reply, Reply]:
        """Read two replies; a small bulk string followed by an integer is parsed in one step.

        That is the answer to ``LMOVE`` + ``PEXPIRE`` (every get): when both have
        arrived, one match finds them and the body is copied once, into a
        writable ``bytearray``. Anything else goes through :meth:`read`.
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
        return self.read(), self.read()

    def read(self) -> Reply:
        """Read one reply. Error replies are *returned* as :class:`ReplyError` (callers raise)."""
        line = self._line()
        kind = line[0]
        if kind == _BULK:
            n = _int(line[1:])
            return None if n < 0 else self._exact(n)
        if kind == _INTEGER:
            return _int(line[1:])
        if kind == _SIMPLE:
            return line[1:].decode("utf-8", "replace")
        if kind == _ERROR:
            return ReplyError(line[1:].decode("utf-8", "replace"))
        if kind == _ARRAY:
            n = _int(line[1:])
            return None if n < 0 else [self.read() for _ in range(n)]
        raise ProtocolError(f"unexpected RESP type byte {bytes(line[:1])!r}")

    def read_bulk_into(self, dest: memoryview) -> bool:
        """Read a bulk-string reply of exactly ``len(dest)`` bytes into ``dest``.

        Returns False for a nil reply. Raises :class:`ReplyError` for an error
        reply and :class:`ProtocolError` when the size differs (the stream is
        then out of step and the connection must be dropped).
        """
        n = self.read_bulk_size()
        if n < 0:
            return False
        if n != dest.nbytes:
            raise ProtocolError(f"stored part is {n} bytes, manifest says {dest.nbytes}")
        self._read_into(dest)
        return True

    def read_bulk_size(self) -> int:
        """The length of the next bulk-string reply (-1: nil); its body must follow with :meth:`read_body_into`.

        Lets a caller check the size before it allocates the destination. Raises
        like :meth:`read_bulk_into`; after a size the caller does not read, the
        connection must be dropped.
        """
        line = self._line()
        kind = line[0]
        if kind == _ERROR:
            raise ReplyError(line[1:].decode("utf-8", "replace"))
        if kind != _BULK:
            raise ProtocolError(f"expected a bulk string, got type byte {bytes(line[:1])!r}")
        return _int(line[1:])

    def read_body_into(self, dest: memoryview) -> None:
        """The body (and CRLF) of the bulk string whose size :meth:`read_bulk_size` returned, into ``dest`` of that size."""
        self._read_into(dest)


_SIMPLE, _ERROR, _INTEGER, _BULK, _ARRAY = b"+-:$*"
# Longest line (or small reply) the reader buffers before calling the stream corrupt.
_MAX_LINE = 16 * 1024 * 1024
# ``count`` integer replies in a row, e.g. ":1\r\n:0\r\n" (the replies of deferred DEL/UNLINKs).
_BULK_HEAD = re.compile(rb"\$(\d{1,19})\r\n")
_CRLF_INTEGER = re.compile(rb"\r\n:(\d{1,19})\r\n")
_INTEGERS = {count: re.compile(rb"(?::\d{1,19}\r\n){%d}" % count) for count in range(1, 9)}


def _int(text: bytes | bytearray) -> int:
    if not 0 < len(text) <= 20 or not (text.isdigit() or (text[0] == 45 and text[1:].isdigit())):
        raise ProtocolError(f"bad RESP integer {bytes(text[:32])!r}")
    return int(text)
