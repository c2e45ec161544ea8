"""The 'fs-dir' connector's services: what a run left in the directory, freeing it, and the raw baseline.

``omni-plugins run`` calls ``census`` and ``reclaim`` after every stage process exited, for every
connector instance of the pipeline; ``omni-plugins bench`` measures the connector against
``raw_baseline`` with the config of ``bench_config``. No server: a directory needs none.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omni_plugins.services import ConnectorServices, Finding, PrivateServer, RawBaseline, RunScope
from omni_plugins_fs_dir.config import FsDirConfig


def _run_files(config: FsDirConfig, run: RunScope) -> list[str]:
    """The payload files of the run's keys (every key of the run starts with its request prefix; keys over
    100 bytes are stored under a hash and cannot be told apart)."""
    from omni_plugins_fs_dir.connector import PAYLOAD_PREFIX

    start = PAYLOAD_PREFIX + run.request_prefix.encode("utf-8").hex()
    try:
        return sorted(n for n in os.listdir(config.directory) if n.startswith(start))
    except FileNotFoundError:
        return []


class FsDirServices(ConnectorServices[FsDirConfig]):
    preload = ("omni_plugins_fs_dir.connector",)

    def census(self, config: FsDirConfig, run: RunScope) -> Finding:
        left = _run_files(config, run)
        return Finding(len(left), "payload file(s) of this run", f"in {config.directory}", tuple(left[:5]))

    def reclaim(self, config: FsDirConfig, run: RunScope) -> Finding:
        removed = 0
        for name in _run_files(config, run):
            try:
                os.unlink(os.path.join(config.directory, name))
                removed += 1
            except FileNotFoundError:  # read meanwhile
                pass
        return Finding(removed, "payload file(s) of this run", f"from {config.directory}")

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        return {"directory": str(scratch / "payloads")}

    def raw_baseline(self, config: FsDirConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_fs_dir.baseline import FileRaw

        return FileRaw(config.directory)
