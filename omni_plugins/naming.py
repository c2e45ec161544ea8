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
    "vllm_omni": "omni-plugins-vllm-omni",
}

# Connectors the core registers itself (omni_plugins.builtin), canonical names and aliases.
BUILTIN_CONNECTORS: frozenset[str] = frozenset({"memory", "inprocessconnector"})


def known_distribution(name: str) -> str | None:
    """The project distribution that owns connector or distribution suffix ``name`` (``shm``, ``mooncake``...), if any."""
    key = canonical(name)
    if key in BUILTIN_CONNECTORS:
        return "omni-plugins"
    if key in KNOWN_BACKENDS:
        return KNOWN_BACKENDS[key].partition("[")[0]
    dists = {d.partition("[")[0] for d in KNOWN_BACKENDS.values()}
    return next((d for d in sorted(dists) if canonical(d) == canonical(f"omni-plugins-{name}")), None)
