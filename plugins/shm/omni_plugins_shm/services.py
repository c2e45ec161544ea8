"""The shm connector's services: leak census and reclaim per namespace, and the raw baseline.

No server: shared memory needs none. Imported only when a service is asked for.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.targets import SizeTarget
from omni_plugins.bench.units import KIB, MIB
from omni_plugins.services import ConnectorServices, Finding, PrivateServer, RunScope

if TYPE_CHECKING:
    from omni_plugins.services import RawBaseline
    from omni_plugins_shm.config import ShmConfig


class ShmServices(ConnectorServices["ShmConfig"]):
    preload = ("omni_plugins_shm.connector",)
    #: zero-copy gets (``zero_copy: true``): tensors that are views over the shared segment
    bench_variants = {"views": {"zero_copy": True}}
    bench_targets = (
        SizeTarget(">= 0.9x the raw two-copy at every size from 64 KiB up", "ratio", 0.9, min_size=64 * KIB),
        SizeTarget("4 KiB round trip <= 1.5x a pipe ping-pong", "round_trip_vs_pipe", 1.5, min_size=4 * KIB, max_size=4 * KIB),
        SizeTarget("zero-copy views >= 1.5x the raw two-copy from 16 MiB up", "ratio", 1.5, min_size=16 * MIB, variant="views"),
    )

    def census(self, config: ShmConfig, run: RunScope) -> Finding:
        """Every file left in the connector's namespace (payload names are hashed: the namespace is the scope)."""
        from omni_plugins_shm.testing import namespace_segments

        left = namespace_segments(config.namespace, config.shm_dir)
        return Finding(len(left), "shm file(s)", f"in {config.shm_dir}", tuple(left[:5]))

    def reclaim(self, config: ShmConfig, run: RunScope) -> Finding:
        """What :func:`omni_plugins_shm.gc.collect` frees in the namespace: exactly the files of dead or closed owners."""
        from omni_plugins_shm import gc

        report = gc.collect(config.namespace, shm_dir=config.shm_dir)
        return Finding(len(report.removed), "shm file(s) of stopped stages")

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        return {"namespace": f"bench-{uuid.uuid4().hex[:8]}", "pool_bytes": 2 * max_bytes + (8 << 20)}

    def raw_baseline(self, config: ShmConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_shm.baseline import ShmRaw

        return ShmRaw(max_bytes, producer)
