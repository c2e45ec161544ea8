"""The fixed-size prefix, alignment and decoder limits of the wire format.

Layout of one encoded message (all integers little-endian)::

    offset 0   magic      4 bytes  b"OMNW"
           4   version    u8       FORMAT_VERSION
           5   flags      u8       0 (reserved, must be 0)
           6   reserved   u16      0
           8   header_len u32      length of the msgpack header
          12   header_crc u32      zlib.crc32 of the header bytes
          16   total_len  u64      length of the whole message
          24   header     msgpack  [tree, table]
               padding    zeros up to data_start = align(24 + header_len)
   data_start  buffers    each at a 64-byte aligned offset relative to data_start
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from omni_plugins.errors import WireFormatError

MAGIC = b"OMNW"
FORMAT_VERSION = 1
ALIGNMENT = 64
PREFIX = struct.Struct("<4sBBHIIQ")
PREFIX_SIZE = PREFIX.size  # 24

# ExtType codes used inside the header tree.
EXT_REF = 1  # the next entry of the buffer table (tensor, array or large bytes)
EXT_TUPLE = 2  # first element of a msgpack array that stands for a tuple


def align(n: int) -> int:
    """Round ``n`` up to the next multiple of :data:`ALIGNMENT`."""
    return (n + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


@dataclass(frozen=True)
class Limits:
    """Bounds the decoder enforces before it builds anything (the encoder honours them too).

    ``max_header_bytes`` caps the msgpack header, ``max_depth`` the nesting of containers
    (the root container is depth 1), ``max_items`` the total number of container
    elements plus buffer-table entries, ``max_ndim`` the rank of one tensor.
    """

    max_header_bytes: int = 16 << 20
    max_depth: int = 64
    max_items: int = 1 << 20
    max_ndim: int = 64


DEFAULT_LIMITS = Limits()


def peek_nbytes(prefix: bytes | bytearray | memoryview) -> int:
    """Total length of the encoded message whose first :data:`PREFIX_SIZE` bytes are ``prefix``.

    For streaming readers: read ``PREFIX_SIZE`` bytes, call this, then read the rest.
    Checks magic and version; raises :class:`WireFormatError` otherwise.
    """
    try:
        mv = memoryview(prefix).cast("B")
    except (TypeError, ValueError) as exc:
        raise WireFormatError(f"prefix is not a contiguous bytes-like object: {exc}") from None
    if mv.nbytes < PREFIX_SIZE:
        raise WireFormatError(f"truncated prefix: need {PREFIX_SIZE} bytes, got {mv.nbytes}")
    magic, version, flags, reserved, header_len, _crc, total = PREFIX.unpack_from(mv)
    check_prefix(magic, version, flags, reserved)
    if total < align(PREFIX_SIZE + header_len):
        raise WireFormatError(f"total length {total} is smaller than prefix + header ({PREFIX_SIZE + header_len})")
    return int(total)


def check_prefix(magic: bytes, version: int, flags: int, reserved: int) -> None:
    """Raise :class:`WireFormatError` naming the first prefix field that is wrong."""
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {magic!r}: not an omni_plugins.wire message (expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise WireFormatError(f"unsupported version {version} (this decoder reads version {FORMAT_VERSION})")
    if flags != 0 or reserved != 0:
        raise WireFormatError(f"reserved prefix fields are not zero (flags={flags}, reserved={reserved})")
