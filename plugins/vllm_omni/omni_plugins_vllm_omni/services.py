"""The ``vllm-omni`` connector's services: preload of vLLM-Omni, and the census and reclaim of a run's leftovers.

What a run leaves depends on the vLLM-Omni connector wrapped:

- ``SharedMemoryConnector`` names a POSIX shared-memory segment (and a lock file ``shm_<key>_lockfile.lock``)
  after each key in /dev/shm; a run's keys start with its request prefix, so its leftovers are exactly the
  files whose names start with it (or with ``shm_`` and it).
- The transfer engines (NIXL, Mori, Mooncake and Yuanrong TE) keep payloads in the producer's registered
  memory: nothing outlives the stage processes.
- Stores (Mooncake store, Yuanrong) hold payloads on a server this service cannot list: the census says so.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from omni_plugins.services import ConnectorServices, Finding, RunScope, ServiceUnavailable

if TYPE_CHECKING:
    from omni_plugins_vllm_omni.bridge_config import VllmOmniConfig

SHM_DIR = "/dev/shm"
#: vLLM-Omni connectors whose payloads live in the producer's memory (gone with the process)
PRODUCER_MEMORY = frozenset(
    {"NixlConnector", "MoriTransferEngineConnector", "MooncakeTransferEngineConnector", "YuanrongTransferEngineConnector"}
)


class VllmOmniServices(ConnectorServices["VllmOmniConfig"]):
    #: importing vLLM-Omni costs ~20 s of CPU: the fork server of the stage processes does it once for all of them
    preload = ("vllm_omni.distributed.omni_connectors.factory", "omni_plugins_vllm_omni.bridge")

    def census(self, config: VllmOmniConfig, run: RunScope) -> Finding:
        if config.connector in PRODUCER_MEMORY:
            return Finding(0, "payload(s)", "in the stopped producers' memory")
        files = _shm_files(config, run)
        return Finding(len(files), "vLLM-Omni shared-memory file(s)", f"in {SHM_DIR}", tuple(files[:5]))

    def reclaim(self, config: VllmOmniConfig, run: RunScope) -> Finding:
        if config.connector in PRODUCER_MEMORY:
            return Finding(0, "payload(s)")
        removed = 0
        for name in _shm_files(config, run):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                continue
            removed += 1
        return Finding(removed, "vLLM-Omni shared-memory file(s) of this run")


def _shm_files(config: VllmOmniConfig, run: RunScope) -> list[str]:
    """The run's segments and lock files of vLLM-Omni's ``SharedMemoryConnector``."""
    if config.connector != "SharedMemoryConnector":
        raise ServiceUnavailable(f"what vLLM-Omni's {config.connector} holds cannot be listed from here")
    prefix = run.request_prefix
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix) or n.startswith(f"shm_{prefix}"))
