"""Redis key names of one payload.

Every key of a payload is ``<prefix>{<key>}:<role>``. The braces make the
escaped user key the Redis Cluster *hash tag*, so the manifest, the parts,
the claim lists and the commit marker of one payload live in the same slot
(one node, one connection, MULTI allowed). ``%``, ``{`` and ``}`` in user keys
are percent-escaped so the tag is never cut short and names stay unique.

Roles:
    ``m``            the manifest list (one element per committed put);
                     its presence makes the payload visible.
    ``p:<put>:<i>``  part ``i`` of put ``<put>`` (large payloads only).
    ``w:<put>``      commit marker: proves a put's manifest went in, so a
                     writer retrying after a lost reply never commits twice.
    ``c:<get>``      claim list: a reader moves the manifest here atomically,
                     so a reply lost in a server restart loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from redis.crc import key_slot


def escape_key(key: str) -> str:
    """Escape a user key for use inside a hash tag (injective)."""
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


@dataclass(frozen=True)
class PayloadKeys:
    """Names of all Redis keys of one user key under one prefix."""

    prefix: str
    key: str

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"key must be a non-empty string, got {self.key!r}")

    @cached_property
    def base(self) -> bytes:
        return f"{self.prefix}{{{escape_key(self.key)}}}".encode()

    @cached_property
    def manifest(self) -> bytes:
        return self.base + b":m"

    def part(self, put_id: str, index: int) -> bytes:
        return self.base + f":p:{put_id}:{index}".encode()

    def parts(self, put_id: str, count: int) -> list[bytes]:
        return [self.part(put_id, i) for i in range(count)]

    def marker(self, put_id: str) -> bytes:
        return self.base + f":w:{put_id}".encode()

    def claim(self, get_id: str) -> bytes:
        return self.base + f":c:{get_id}".encode()

    @cached_property
    def slot(self) -> int:
        """Cluster slot of every key of this payload."""
        return int(key_slot(self.manifest))
