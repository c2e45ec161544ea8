"""The ``memory`` connector's services: census and reclaim of one run's keys in this process's stores.

The memory connector's payloads live in the process that put them, so these services see what
that process holds: an in-process pipeline (or a test) checks and frees what a run left exactly as
``omni-plugins run`` does for a backend that outlives its processes.
"""

from __future__ import annotations

from omni_plugins.memory import MemoryConfig, MemoryConnector
from omni_plugins.services import ConnectorServices, Finding, RunScope


class MemoryServices(ConnectorServices[MemoryConfig]):
    def census(self, config: MemoryConfig, run: RunScope) -> Finding:
        keys = [k for k in MemoryConnector.namespace_keys(config.namespace) if k.startswith(run.request_prefix)]
        return Finding(len(keys), "stored payload(s) of this run", f"in memory namespace {config.namespace!r}", tuple(keys[:5]))

    def reclaim(self, config: MemoryConfig, run: RunScope) -> Finding:
        removed = MemoryConnector.discard_namespace_keys(config.namespace, run.request_prefix)
        return Finding(removed, "stored payload(s) of this run", f"from memory namespace {config.namespace!r}")
