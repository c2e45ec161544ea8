"""Mooncake's integer error codes, named for messages."""

from __future__ import annotations

BUFFER_TOO_SMALL = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
LEASE_EXPIRED = -707

_NAMES = {
    -1: "transfer failed",
    -200: "segment not mounted / client not ready",
    -600: "buffer too small",
    -703: "replica not ready: a put of the key is still under way",
    -704: "object not found",
    -706: "object has a lease (remove with force)",
    -707: "lease expired during the read: the transfer took longer than the master's default_kv_lease_ttl",
    -900: "RPC to the master failed (master down or restarting)",
}


def describe(code: int) -> str:
    """``'code -704 (object not found)'``."""
    name = _NAMES.get(code)
    return f"code {code} ({name})" if name else f"code {code}"
