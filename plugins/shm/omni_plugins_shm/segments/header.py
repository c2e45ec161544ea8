"""The fixed header at the start of every segment.

Layout (little-endian, 128 bytes reserved, payload starts at :data:`PAYLOAD_OFFSET`)::

    magic[8] flags:u32 state:u32 pid:u32 tag:u32 start:u64 seg_no:u64
    capacity:u64 payload_len:u64 key_digest[16] crc32:u32

``state`` holds two mutable bytes left out of the CRC: byte 12 is FREE/BUSY
(the consumer sets FREE right *after* renaming a pooled segment back to its
``f.`` name, so FREE means "named ``f.`` and nobody reads it": the owner reuses
it without a syscall), byte 13 is set by the owner when it closes (a consumer
returning a segment afterwards unlinks it instead). Everything else is covered by the CRC, so a torn or foreign file
is reported as corrupt instead of being trusted.

A segment published under several keys (``put_many``, flag SHARED) holds in
``key_digest`` the digest of a key table written right after the payload: the
digests of every key it is published under (see :mod:`.shared`).
"""

from __future__ import annotations

import mmap
import struct
import zlib
from typing import NamedTuple

from omni_plugins_shm.proc import Owner

MAGIC = b"OMNISHM\x01"
_FMT = struct.Struct("<8sIIIIQQQQ16s")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FMT.size + _CRC.size
PAYLOAD_OFFSET = 128
STATE_OFFSET = 12
CLOSED_OFFSET = 13
STATE_BUSY = 1
STATE_FREE = 0
FLAG_POOLED = 1
#: published by an instance with the slot table, which counted it in the table's file-path hint (see slots.py)
FLAG_COUNTED = 2
#: published under several keys (one name each); ``key_digest`` is the digest of the key table after the payload
FLAG_SHARED = 4

assert HEADER_SIZE <= PAYLOAD_OFFSET


class HeaderError(ValueError):
    """The bytes at the start of a segment are not a valid header."""


class Header(NamedTuple):
    """Decoded header fields (a NamedTuple: built on every get, and cheaper than a frozen dataclass)."""

    owner: Owner
    seg_no: int
    capacity: int
    payload_len: int
    key_digest: bytes
    pooled: bool
    counted: bool = False
    shared: bool = False

    def pack(self, state: int = STATE_BUSY) -> bytes:
        body = _FMT.pack(
            MAGIC,
            (FLAG_POOLED if self.pooled else 0) | (FLAG_COUNTED if self.counted else 0) | (FLAG_SHARED if self.shared else 0),
            state,
            self.owner.pid,
            self.owner.tag,
            self.owner.start,
            self.seg_no,
            self.capacity,
            self.payload_len,
            self.key_digest,
        )
        return body + _CRC.pack(_crc(body))

    @classmethod
    def unpack(cls, raw: bytes | memoryview | mmap.mmap, file_size: int) -> Header:
        if len(raw) < HEADER_SIZE:
            raise HeaderError(f"segment is {file_size} bytes, shorter than its {HEADER_SIZE}-byte header")
        magic, flags, _state, pid, tag, start, seg_no, capacity, payload_len, digest = _FMT.unpack_from(raw, 0)
        if magic != MAGIC:
            raise HeaderError(f"bad magic {magic!r} (not an omnishm segment or an unsupported version)")
        (crc,) = _CRC.unpack_from(raw, _FMT.size)
        if crc != _crc(raw):
            raise HeaderError("header checksum mismatch (corrupt or torn segment)")
        if capacity != file_size:
            raise HeaderError(f"header says capacity {capacity} but the file is {file_size} bytes")
        if PAYLOAD_OFFSET + payload_len > capacity:
            raise HeaderError(f"payload length {payload_len} exceeds capacity {capacity}")
        return cls(
            Owner(pid, start, tag),
            seg_no,
            capacity,
            payload_len,
            digest,
            bool(flags & FLAG_POOLED),
            bool(flags & FLAG_COUNTED),
            bool(flags & FLAG_SHARED),
        )


def _crc(body: bytes | memoryview | mmap.mmap) -> int:
    """CRC of the header fields, leaving out the mutable state word (bytes 12..15).

    Slicing works alike for bytes, memoryviews and mmaps (no temporary memoryview to release).
    """
    return zlib.crc32(body[STATE_OFFSET + 4 : _FMT.size], zlib.crc32(body[:STATE_OFFSET]))
