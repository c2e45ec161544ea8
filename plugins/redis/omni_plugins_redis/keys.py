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

from collections.abc import Iterator

from redis.crc import key_slot


def escape_key(key: str) -> str:
    """Escape a user key for use inside a hash tag (injective)."""
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


class PayloadKeys:
    """Names of all Redis keys of one user key under one prefix (computed once: hot path)."""

    __slots__ = ("_slot", "base", "key", "manifest", "prefix")

    def __init__(self, prefix: str, key: str, *, slot: int = -1) -> None:
        """``slot=0`` when nothing routes by slot (a single server): skips the CRC16."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        self.prefix = prefix
        self.key = key
        tag = escape_key(key) if ("%" in key or "{" in key or "}" in key) else key
        self.base = f"{prefix}{{{tag}}}".encode()
        self.manifest = self.base + b":m"
        self._slot = slot

    @property
    def slot(self) -> int:
        """The cluster slot of every key of this payload (computed on first use)."""
        if self._slot < 0:
            # the slot of "<prefix>{tag}..." is the CRC16 of the tag (tags are never empty)
            self._slot = int(key_slot(self.manifest))
        return self._slot

    def part(self, put_id: str, index: int) -> bytes:
        return self.base + f":p:{put_id}:{index}".encode()

    def parts(self, put_id: str, count: int) -> list[bytes]:
        return [self.part(put_id, i) for i in range(count)]

    def part_batches(self, put_id: str, count: int, size: int) -> Iterator[list[bytes]]:
        """The names of parts ``0..count-1``, ``size`` at a time, made as they are consumed (``count`` may be untrusted)."""
        for start in range(0, count, size):
            yield [self.part(put_id, i) for i in range(start, min(start + size, count))]

    def marker(self, put_id: str) -> bytes:
        return self.base + f":w:{put_id}".encode()

    def claim(self, get_id: str) -> bytes:
        return self.base + f":c:{get_id}".encode()
