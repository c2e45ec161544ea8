"""``Encoded``: a message that references the caller's tensors instead of copying them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omni_plugins.errors import WireFormatError

_ZEROS = bytes(64)

#: below this, memoryview assignment wins; above it torch's multi-threaded ``copy_``
#: is faster (~9 GB/s against ~6 GB/s for one thread on an idle machine). On a loaded
#: machine torch's thread pool costs milliseconds per call (1 MiB: 15.6 ms against
#: 0.31 ms for a memoryview copy), so only large buffers take it.
TORCH_COPY_MIN = 32 * 1024 * 1024


def _copy(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (same length) the fastest way for its size."""
    if src.nbytes >= TORCH_COPY_MIN and not src.readonly:  # torch warns on read-only sources
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        dst[:] = src


class Segment:
    """One out-of-band buffer: where it goes in the message and what holds its bytes."""

    __slots__ = ("nbytes", "offset", "source")

    def __init__(self, offset: int, nbytes: int, source: Any) -> None:
        self.offset = offset  # offset relative to the start of the data section
        self.nbytes = nbytes
        self.source = source  # contiguous CPU torch.Tensor (numpy-compatible dtype), C-contiguous np.ndarray, or bytes

    def view(self) -> memoryview:
        """A flat uint8 memoryview over the source's memory (no copy).

        ``WireFormatError`` if the source no longer has the size the header declares (a tensor resized
        between ``encode`` and the write).
        """
        src = self.source
        if type(src) is bytes:
            out = memoryview(src)
        else:
            if isinstance(src, torch.Tensor):
                src = src.numpy()
            try:  # C-contiguous with no zero in the shape (empty segments are never viewed)
                out = memoryview(src).cast("B")
            except (TypeError, ValueError):
                out = memoryview(src.reshape(-1).view(np.uint8))
        if out.nbytes != self.nbytes:
            raise WireFormatError(f"a buffer of {self.nbytes} bytes changed size to {out.nbytes} after it was encoded")
        return out


class Encoded:
    """An encoded payload: a small head (prefix + header) plus views of the tensors' memory.

    Nothing is copied until :meth:`write_into` / :meth:`to_bytes`; the referenced tensors
    must therefore not be modified before the bytes are written out.
    """

    __slots__ = ("_data_start", "_head", "_segments", "nbytes")

    def __init__(self, head: bytes, data_start: int, segments: list[Segment], nbytes: int) -> None:
        self._head = head  # prefix + header + zero padding, len(head) == data_start
        self._data_start = data_start
        self._segments = segments
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"Encoded(nbytes={self.nbytes}, buffers={len(self._segments)})"

    def __len__(self) -> int:
        return self.nbytes

    def buffers(self) -> list[memoryview]:
        """Flat uint8 views whose concatenation equals :meth:`to_bytes` (for vectored writes).

        Padding between buffers is included as views of a static zero block.
        """
        out = [memoryview(self._head)]
        cursor = 0
        zeros = memoryview(_ZEROS)
        for seg in self._segments:
            if seg.offset > cursor:
                out.append(zeros[: seg.offset - cursor])
            if seg.nbytes:
                out.append(seg.view())
            cursor = seg.offset + seg.nbytes
        return out

    def write_into(self, dest: Any) -> int:
        """Copy the message into ``dest`` (any writable C-contiguous buffer) and return its length.

        This is the single copy a backend pays to move a payload into memory it owns
        (a shared-memory arena, a registered transfer buffer). Bytes after ``nbytes``
        are left untouched.
        """
        try:
            mv = memoryview(dest)
        except TypeError as exc:
            raise WireFormatError(f"write_into needs a writable buffer, got {type(dest).__name__}") from exc
        if mv.readonly:
            raise WireFormatError("write_into destination is read-only")
        if not mv.c_contiguous:
            raise WireFormatError("write_into destination is not C-contiguous")
        if mv.format != "B" or mv.ndim != 1:
            try:
                mv = mv.cast("B")
            except TypeError as exc:
                raise WireFormatError(f"write_into destination is not C-contiguous: {exc}") from exc
        if mv.nbytes < self.nbytes:
            raise WireFormatError(f"write_into destination too small: {mv.nbytes} bytes < {self.nbytes} needed")
        base = self._data_start
        mv[:base] = self._head
        cursor = base
        for seg in self._segments:
            start = base + seg.offset
            if start > cursor:
                mv[cursor:start] = _ZEROS[: start - cursor]
            if seg.nbytes:
                _copy(mv[start : start + seg.nbytes], seg.view())
            cursor = start + seg.nbytes
        return self.nbytes

    def to_bytes(self) -> bytes:
        """The whole message as one ``bytes`` object (one copy)."""
        return b"".join(self.buffers())
