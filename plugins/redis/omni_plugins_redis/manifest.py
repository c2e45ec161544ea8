"""The manifest: the small element whose arrival makes a payload visible.

Layout (little endian, 40-byte header)::

    magic "ORM1" | flags u8 | 3 reserved | total u64 | chunk u32 | nparts u32 | put id (16 ascii hex)
    [inline payload bytes when nparts == 0]

Small payloads travel inline, so a put and a get are one round trip each.
Large ones are split into ``nparts`` parts of ``chunk`` bytes (the last one
shorter). Bytes read back from Redis are untrusted: :func:`parse` checks every
field against the others and against a size cap before anything is allocated.
``chunk`` must lie within the bounds ``RedisConfig.chunk_bytes`` allows any
writer, and ``nparts`` must be ``ceil(total / chunk)``, so a manifest that
passes announces at most ``max_total / MIN_CHUNK_BYTES`` parts. Per-part
values are computed on demand (:meth:`Manifest.part_span`), never as a list
sized by ``nparts`` before a single part was read.
"""

from __future__ import annotations

import random
import struct
from typing import NamedTuple

from omni_plugins_redis.config import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES

_HEADER = struct.Struct("<4sB3xQII16s")
HEADER_SIZE = _HEADER.size
MAGIC = b"ORM1"
_HEX_CHARS = b"0123456789abcdef"


class ManifestError(ValueError):
    """A manifest read from Redis is malformed."""


def new_put_id() -> str:
    """A random id naming one put's parts and commit marker.

    From :mod:`random` (seeded from ``os.urandom``, reseeded in forked children):
    an id only has to be unique, and ``os.urandom`` costs a system call per put.
    """
    return f"{random.getrandbits(64):016x}"


class Manifest(NamedTuple):
    """Parsed header (a named tuple: cheap to build on every get)."""

    total: int
    chunk: int
    nparts: int
    put_id: str

    @property
    def inline(self) -> bool:
        return self.nparts == 0

    def part_span(self, index: int) -> tuple[int, int]:
        """Where part ``index`` lies in the payload: ``(start, stop)`` byte offsets (the last part is shorter)."""
        start = index * self.chunk
        return start, min(start + self.chunk, self.total)

    def header(self) -> bytes:
        return _HEADER.pack(MAGIC, 0, self.total, self.chunk, self.nparts, self.put_id.encode())


def for_parts(total: int, chunk: int, put_id: str) -> Manifest:
    return Manifest(total=total, chunk=chunk, nparts=-(-total // chunk), put_id=put_id)


def for_inline(total: int, put_id: str) -> Manifest:
    return Manifest(total=total, chunk=0, nparts=0, put_id=put_id)


_NPARTS_OFFSET = 4 + 1 + 3 + 8 + 4


def looks_inline(raw: bytes | bytearray) -> bool:
    """Whether an element claims to carry its payload inline (a hint before :func:`parse` validates it)."""
    return len(raw) >= HEADER_SIZE and raw[_NPARTS_OFFSET : _NPARTS_OFFSET + 4] == b"\0\0\0\0"


def parse(raw: bytes | bytearray, max_total: int) -> Manifest:
    """Validate and unpack a manifest; raises :class:`ManifestError`."""
    if len(raw) < HEADER_SIZE:
        raise ManifestError(f"manifest is {len(raw)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, flags, total, chunk, nparts, put_id = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise ManifestError(f"bad manifest magic {magic!r}")
    if flags != 0:
        raise ManifestError(f"unknown manifest flags {flags:#x}")
    if put_id.strip(_HEX_CHARS):
        raise ManifestError("manifest put id is not hex")
    if total > max_total:
        raise ManifestError(f"manifest announces {total} bytes, above max_payload_bytes={max_total}")
    manifest = Manifest(total=total, chunk=chunk, nparts=nparts, put_id=put_id.decode())
    if nparts == 0:
        if chunk != 0 or len(raw) != HEADER_SIZE + total:
            raise ManifestError("inline manifest length does not match its header")
    else:
        if len(raw) != HEADER_SIZE:
            raise ManifestError("parted manifest carries trailing bytes")
        if not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
            raise ManifestError(f"manifest chunk={chunk} outside the {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} bytes any writer uses")
        if total == 0 or nparts != -(-total // chunk):
            raise ManifestError(f"inconsistent manifest: total={total} chunk={chunk} nparts={nparts}")
    return manifest
