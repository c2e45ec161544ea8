"""One segment published under several keys (``put_many``): its key table and the last name out.

A fan-out's payload is written once into one segment and published under
every key with ``link`` (one hard link per key, in the publish directory).
Each consumer claims its own name with ``rename`` as for any payload, so the
claim/consume protocol and its liveness rules are unchanged. What changes is
the way out: a consumer (or a producer freeing an unread name) drops its name
unless it is the last one, and whoever holds the last name frees the segment
as usual (a pooled one back to its owner, marked FREE). Whether a name is the
last is read from the inode's link count under an exclusive ``flock`` on the
segment, taken by every leaver and by the producer while it publishes, so two
leavers never both count the other's name and none leaves before the
producer has dropped its own. A dedicated segment needs none of this: each
name is simply unlinked and the kernel frees the memory after the last.

Which keys a segment serves: its header's key digest is the digest of the key
table written right after the payload (``u32`` count, then one 16-byte key
digest per key), so a consumer checks the table against the header (whose CRC
covers that digest) and then that its own key is in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
from collections.abc import Callable, Iterator, Sequence

from omni_plugins_shm.segments.files import unlink_quiet
from omni_plugins_shm.segments.header import PAYLOAD_OFFSET, Header, HeaderError

_COUNT = struct.Struct("<I")
_DIGEST = 16
#: most keys one segment is published under
MAX_KEYS = 4096


def key_table(digests: Sequence[bytes]) -> bytes:
    """The key table of a segment published under keys with these digests."""
    return _COUNT.pack(len(digests)) + b"".join(digests)


def table_digest(table: bytes) -> bytes:
    """What the header of a shared segment holds as its key digest."""
    return hashlib.blake2b(table, digest_size=_DIGEST).digest()


def check_key_table(read: Callable[[int, int], bytes], header: Header, digest: bytes) -> None:
    """Raise :class:`HeaderError` unless the key table after the payload matches the header and lists ``digest``.

    ``read(offset, size)`` reads the segment's bytes (a mapping or the file).
    """
    start = PAYLOAD_OFFSET + header.payload_len
    if start + _COUNT.size > header.capacity:
        raise HeaderError("a shared segment without room for its key table")
    (count,) = _COUNT.unpack(read(start, _COUNT.size))
    end = start + _COUNT.size + count * _DIGEST
    if not 0 < count <= MAX_KEYS or end > header.capacity:
        raise HeaderError(f"the key table announces {count} keys that do not fit")
    table = read(start, end - start)
    if len(table) != end - start or table_digest(table) != header.key_digest:
        raise HeaderError("its key table does not match its header")
    if all(table[i : i + _DIGEST] != digest for i in range(_COUNT.size, len(table), _DIGEST)):
        raise HeaderError("it holds a payload for different keys")


@contextlib.contextmanager
def locked(path: str) -> Iterator[int]:
    """Hold the exclusive ``flock`` of the segment at ``path`` (its own open file, so threads of one process exclude
    each other too); yields the fd. ``FileNotFoundError`` when the name is gone."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # and the lock with it


def leave(path: str) -> bool:
    """Drop the name ``path`` of a pooled shared segment unless it is the last one; True when it is (free it now).

    False also when the name is gone already (gc removed it). A process out of descriptors cannot take
    the lock: it drops its name all the same; if that was the last, the owner's pool misses the segment
    until the owner closes (harmless, as when ``free_claimed`` cannot read a header).
    """
    try:
        with locked(path) as fd:
            if os.fstat(fd).st_nlink > 1:
                unlink_quiet(path)
                return False
            return True
    except FileNotFoundError:
        return False
    except OSError:
        unlink_quiet(path)
        return False
