"""Canonical connector names and close-match suggestions."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def canonical(name: str) -> str:
    """Case-insensitive, ``-`` equals ``_``, surrounding blanks ignored."""
    return name.strip().lower().replace("-", "_")


def close_matches(name: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """Candidates that look like ``name`` (for "did you mean" hints)."""
    pool = {canonical(c): c for c in candidates}
    hits = difflib.get_close_matches(canonical(name), list(pool), n=n, cutoff=cutoff)
    return [pool[h] for h in hits]


def is_import_path(name: str) -> bool:
    """``package.module:Class`` names an unregistered connector class directly."""
    module, sep, attr = name.partition(":")
    return bool(sep) and "." in module and attr.isidentifier()


# The project's own backends, so an unknown name can say what to install.
KNOWN_BACKENDS: dict[str, str] = {
    "shm": "omni-plugins-shm",
    "sharedmemoryconnector": "omni-plugins-shm",
    "redis": "omni-plugins-redis",
    "redisconnector": "omni-plugins-redis",
    "mooncake_store": "omni-plugins-mooncake[cpu]",
    "mooncakestoreconnector": "omni-plugins-mooncake[cpu]",
    "mooncakeconnector": "omni-plugins-mooncake[cpu]",
    "mooncake_te": "omni-plugins-mooncake[cpu]",
    "mooncaketransferengineconnector": "omni-plugins-mooncake[cpu]",
}
