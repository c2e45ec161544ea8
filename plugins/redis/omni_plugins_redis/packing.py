"""RESP framing of commands whose large values stay where they are (tensor memory).

redis-py's packers cannot send a tensor without copying it: hiredis's packer
turns every ``memoryview`` into ``bytes`` first (most of a 64 MiB ``SET`` is
spent there, see docs/redis.md), and neither packer can send one bulk string
made of several buffers (a part that spans the wire header and a tensor, or
two tensors). Here a command is framed into a list of buffers: the small
framing is joined into ``bytes``, each large value buffer is passed through
untouched, and the list goes to redis-py's ``Connection.send_packed_command``,
which hands each buffer to the socket as it is: the kernel copies the tensor,
Python never does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Buffers at least this large are sent as their own item instead of being joined.
_BIG = 32 * 1024

Buffer = bytes | bytearray | memoryview


class Pieces:
    """One bulk argument made of several buffers (a part spanning encoder buffers)."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: Sequence[Buffer]) -> None:
        self.buffers = [as_bytes_view(b) for b in buffers]
        self.nbytes = sum(b.nbytes for b in self.buffers)

    def joined(self) -> bytes:
        return b"".join(self.buffers)


Arg = bytes | str | int | float | memoryview | Pieces


def as_bytes_view(buf: Buffer) -> memoryview:
    view = buf if isinstance(buf, memoryview) else memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


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


def pack(*args: Arg) -> list[Buffer]:
    """Frame one command; returns buffers whose concatenation is the RESP bytes."""
    return pack_many([args])


def pack_many(commands: Iterable[Sequence[Arg]]) -> list[Buffer]:
    """Frame a pipeline of commands; small pieces are joined, large value buffers passed through."""
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
