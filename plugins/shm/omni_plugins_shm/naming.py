"""Segment names: ``omnishm.<namespace>.<kind>.<rest>`` in the shm directory.

Kinds (the state of a segment is its name; ``rename`` moves it between states atomically):

- ``o.<owner>``: liveness marker of one connector instance (empty file).
- ``w.<owner>.<n>``: segment ``n`` of ``owner`` being written.
- ``f.<owner>.<n>``: pooled segment returned to its owner, free for reuse.
- ``k.<key>`` / ``h.<blake2b-128 hex>``: a published payload; derived from the key alone, so a
  consumer needs nothing but the key. Keys with characters outside ``[A-Za-z0-9_.-]`` or too
  long for ``NAME_MAX`` are hashed.
- ``c.<owner>.<n>``: a payload claimed by the consumer ``owner`` (consume-once: the claim is a rename).
- ``x.wake``: the namespace's wake file (futex doorbells for blocked gets, :mod:`omni_plugins_shm.wakeslots`).

Published payloads and markers live in the namespace's *publish directory*
``omnishm.<namespace>.d/`` inside the shm directory (same names); every other kind lives in the
shm directory itself. Waiters watch only the publish directory, so claims, returns and other
namespaces never wake them; markers keep the directory non-empty while an instance lives, and
the last instance to close removes it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "omnishm"
NAME_MAX = 255
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")

MARKER, WRITING, FREE, PUBLISHED, HASHED, CLAIMED, WAKE = "o", "w", "f", "k", "h", "c", "x"
KINDS = frozenset({MARKER, WRITING, FREE, PUBLISHED, HASHED, CLAIMED, WAKE})
#: suffix of the publish directory's name: ``omnishm.<namespace>.d``
PUBLISH_DIR = "d"
#: kinds that live in the publish directory
IN_PUBLISH_DIR = frozenset({MARKER, PUBLISHED, HASHED, WAKE})
#: wake slots in the namespace's wake file (see :mod:`omni_plugins_shm.wakeslots`)
WAKE_SLOTS = 256
WAKE_FIRST_SLOT = 64
#: the namespace-wide wake slot (bumped by every publication; ``wait_any`` on the slot table sleeps on it)
WAKE_ANY_SLOT = 56


_FNV_OFFSET, _FNV_PRIME, _U64 = 1469598103934665603, 1099511628211, (1 << 64) - 1


def _wake_slot_py(key: str) -> int:
    h = _FNV_OFFSET
    for byte in key.encode("utf-8", "surrogatepass"):
        h = ((h ^ byte) * _FNV_PRIME) & _U64
    return WAKE_FIRST_SLOT + 8 * (h % WAKE_SLOTS)


def _wake_slot_function() -> Callable[[str], int]:
    try:
        from omni_plugins_shm._native import wake_slot as native
    except ImportError:  # pragma: no cover - the pure-Python install
        return _wake_slot_py

    def wake_slot(key: str) -> int:
        try:
            return int(native(key))
        except UnicodeEncodeError:  # lone surrogates: hashed with surrogatepass like the file names
            return _wake_slot_py(key)

    return wake_slot


#: ``wake_slot(key)``: offset of the key's wake slot in the wake file: FNV-1a 64 of the key's UTF-8 bytes,
#: so the C slot table (which hashes keys the same way) rings the slot a file-path waiter sleeps on
wake_slot = _wake_slot_function()


def key_digest(key: str) -> bytes:
    """16-byte digest of a key, stored in the segment header to verify what a consumer opened."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def namespace_prefix(namespace: str) -> str:
    return f"{PREFIX}.{namespace}."


def publish_dir_name(namespace: str) -> str:
    """Name of the namespace's publish directory in the shm directory."""
    return f"{PREFIX}.{namespace}.{PUBLISH_DIR}"


def relative_path(name: str) -> str:
    """Where the segment or marker ``name`` lives, relative to the shm directory."""
    parsed = parse_name(name)
    if parsed is not None and parsed.kind in IN_PUBLISH_DIR:
        return f"{publish_dir_name(parsed.namespace)}/{name}"
    return name


@dataclass(frozen=True)
class ParsedName:
    """A segment name split into namespace, kind and the rest (owner token / key / digest)."""

    namespace: str
    kind: str
    rest: str

    @property
    def owner_token(self) -> str | None:
        """The owner token of owner-named kinds (``o``, ``w``, ``f``, ``c``)."""
        if self.kind == MARKER:
            return self.rest
        if self.kind in (WRITING, FREE, CLAIMED):
            return self.rest.rsplit(".", 1)[0]
        return None


def parse_name(name: str) -> ParsedName | None:
    """Split a directory entry name; None if it is not an omnishm segment."""
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[0] != PREFIX or parts[2] not in KINDS or not parts[1] or not parts[3]:
        return None
    return ParsedName(parts[1], parts[2], parts[3])


class Names:
    """Builds the names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.prefix = namespace_prefix(namespace)
        #: the publish directory (relative to the shm directory)
        self.publish_dir = publish_dir_name(namespace)

    def marker(self, owner: str) -> str:
        return f"{self.prefix}{MARKER}.{owner}"

    def writing(self, owner: str, n: int) -> str:
        return f"{self.prefix}{WRITING}.{owner}.{n}"

    def free(self, owner: str, n: int) -> str:
        return f"{self.prefix}{FREE}.{owner}.{n}"

    def wake(self) -> str:
        return f"{self.prefix}{WAKE}.wake"

    def slots(self) -> str:
        """The namespace's slot table (small payloads without file syscalls, :mod:`omni_plugins_shm.slots`)."""
        return f"{self.prefix}{WAKE}.slots"

    def claimed(self, owner: str, n: int) -> str:
        return f"{self.prefix}{CLAIMED}.{owner}.{n}"

    def published(self, key: str) -> str:
        """The name a payload for ``key`` is published under (literal when safe, hashed otherwise)."""
        literal = f"{self.prefix}{PUBLISHED}.{key}"
        if _SAFE_KEY.match(key) and len(literal.encode()) <= NAME_MAX:
            return literal
        return f"{self.prefix}{HASHED}.{key_digest(key).hex()}"


class KeyNames:
    """Everything derived from one key, computed once per key (a waiter and a producer ask again and again).

    Same names as :meth:`Names.published`, with the key hashed once (keys are usually unique
    per request, so this runs on every ``put`` and ``get``).
    """

    __slots__ = ("_bytes", "digest", "published", "published_path", "wake_slot")

    def __init__(self, names: Names, publish_dir: str, key: str) -> None:
        raw = key.encode("utf-8", "surrogatepass")
        self.digest = digest = hashlib.blake2b(raw, digest_size=16).digest()
        literal = f"{names.prefix}{PUBLISHED}.{key}"
        if len(literal) + len(raw) - len(key) <= NAME_MAX and _SAFE_KEY.match(key):
            self.published = literal
        else:
            self.published = f"{names.prefix}{HASHED}.{digest.hex()}"
        self.published_path = f"{publish_dir}/{self.published}"
        #: offset of this key's futex slot in the wake file (the C slot table derives the same from the key)
        self.wake_slot = wake_slot(key)
        self._bytes: bytes | None = None

    @property
    def published_bytes(self) -> bytes:
        """The published name as bytes (inotify event names); built on first use (the futex path never needs it)."""
        b = self._bytes
        if b is None:
            b = self._bytes = self.published.encode()
        return b

    @property
    def wanted(self) -> frozenset[bytes]:
        """What an inotify waiter for this key looks for in event names."""
        return frozenset({self.published_bytes})
