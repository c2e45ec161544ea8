"""Errors of the KV transfer layer (both derive from the core hierarchy)."""

from __future__ import annotations

from omni_plugins.errors import ConfigError, OmniPluginsError


class KVPayloadError(OmniPluginsError, ValueError):
    """A KV payload or a request's block description is malformed or inconsistent.

    Raised for received payloads that do not have the documented structure (they
    come from a backend and are untrusted), for shards that cannot be merged, and
    for requests whose ``seq_len`` / ``block_ids`` do not fit the paged cache.
    """


class KVLayoutError(ConfigError):
    """The paged KV caches handed to the sender have a layout this module cannot read unambiguously."""
