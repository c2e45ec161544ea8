"""Segment names: ``omnishm.<namespace>.<kind>.<rest>`` in the shm directory.

Kinds (the state of a segment is its name; ``rename`` moves it between states atomically):

- ``o.<owner>``: liveness marker of one connector instance (empty file).
- ``w.<owner>.<n>``: segment ``n`` of ``owner`` being written.
- ``f.<owner>.<n>``: pooled segment returned to its owner, free for reuse.
- ``k.<key>`` / ``h.<blake2b-128 hex>``: a published payload; derived from the key alone, so a
  consumer needs nothing but the key. Keys with characters outside ``[A-Za-z0-9_.-]`` or too
  long for ``NAME_MAX`` are hashed.
- ``c.<owner>.<n>``: a payload claimed by the consumer ``owner`` (consume-once: the claim is a rename).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

PREFIX = "omnishm"
NAME_MAX = 255
_SAFE_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")

MARKER, WRITING, FREE, PUBLISHED, HASHED, CLAIMED = "o", "w", "f", "k", "h", "c"
KINDS = frozenset({MARKER, WRITING, FREE, PUBLISHED, HASHED, CLAIMED})


def key_digest(key: str) -> bytes:
    """16-byte digest of a key, stored in the segment header to verify what a consumer opened."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def namespace_prefix(namespace: str) -> str:
    return f"{PREFIX}.{namespace}."


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

    def marker(self, owner: str) -> str:
        return f"{self.prefix}{MARKER}.{owner}"

    def writing(self, owner: str, n: int) -> str:
        return f"{self.prefix}{WRITING}.{owner}.{n}"

    def free(self, owner: str, n: int) -> str:
        return f"{self.prefix}{FREE}.{owner}.{n}"

    def claimed(self, owner: str, n: int) -> str:
        return f"{self.prefix}{CLAIMED}.{owner}.{n}"

    def published(self, key: str) -> str:
        """The name a payload for ``key`` is published under (literal when safe, hashed otherwise)."""
        literal = f"{self.prefix}{PUBLISHED}.{key}"
        if _SAFE_KEY.match(key) and len(literal.encode()) <= NAME_MAX:
            return literal
        return f"{self.prefix}{HASHED}.{key_digest(key).hex()}"
