"""The Mooncake connectors' services: the store's run census (which removes) and server, both raw baselines.

Imported only when a service is asked for; ``mooncake`` itself only inside the methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_plugins.bench.targets import SizeTarget
from omni_plugins.bench.units import MIB
from omni_plugins.services import ConnectorServices, Finding, PrivateServer, RunScope, ServiceUnavailable

if TYPE_CHECKING:
    from omni_plugins.services import RawBaseline
    from omni_plugins_mooncake.config import MooncakeStoreConfig, MooncakeTEConfig

#: the variable example pipelines read the master's address from (``${OMNI_MOONCAKE_MASTER:-127.0.0.1:50051}``)
MASTER_VARIABLE = "OMNI_MOONCAKE_MASTER"


#: both connectors: within 0.8x of the raw API from 16 MiB up (below that a payload's fixed costs weigh: see the floors)
LARGE_TARGETS = (SizeTarget(">= 0.8x the raw API from 16 MiB up", "ratio", 0.8, min_size=16 * MIB),)


class StoreServices(ConnectorServices["MooncakeStoreConfig"]):
    preload = ("omni_plugins_mooncake.store",)
    server_variables = {MASTER_VARIABLE: "127.0.0.1:50051"}
    bench_targets = LARGE_TARGETS

    def census(self, config: MooncakeStoreConfig, run: RunScope) -> Finding:
        """This run's objects still in the store, removed: the store cannot count keys by pattern without removing them.

        Only keys of this run's requests are touched: a master is often shared, and every other
        object on it belongs to someone else.
        """
        from mooncake.store import MooncakeDistributedStore

        from omni_plugins_mooncake.testing import loopback_environment

        loopback_environment()
        probe = MooncakeDistributedStore()
        rc = probe.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", config.master_address)
        if rc != 0:
            raise ServiceUnavailable(f"cannot reach mooncake_master at {config.master_address} to check for leftovers")
        try:
            count = int(probe.remove_by_regex(f"^{run.request_prefix}.*", True))
        finally:
            probe.close()
        if count < 0:
            raise ServiceUnavailable(f"mooncake_master at {config.master_address} answered {count}")
        return Finding(count, "store object(s) of this run", f"on {config.master_address}", removed=True)

    def start_server(self) -> PrivateServer:
        """``mooncake_master`` on free loopback ports (RPC and metrics; no HTTP metadata server)."""
        from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment

        loopback_environment()
        try:
            return MooncakeMaster().start()
        except RuntimeError as exc:
            raise ServiceUnavailable(str(exc)) from None

    def server_environment(self, server: PrivateServer) -> Mapping[str, str]:
        return {MASTER_VARIABLE: server.address}

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        segment = 4 * max_bytes + (64 << 20)
        return server.connector_config(global_segment_size=segment) if server is not None else {"global_segment_size": segment}

    def raw_baseline(self, config: MooncakeStoreConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_mooncake.baseline import StoreRaw
        from omni_plugins_mooncake.testing import loopback_environment

        loopback_environment()
        return StoreRaw(config, max_bytes, producer)

    def floor_baseline(self, config: MooncakeStoreConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_mooncake.baseline import StoreFloor
        from omni_plugins_mooncake.testing import loopback_environment

        loopback_environment()
        return StoreFloor(config, max_bytes + (64 << 10), producer)


class TEServices(ConnectorServices["MooncakeTEConfig"]):
    preload = ("omni_plugins_mooncake.te.connector",)
    bench_targets = LARGE_TARGETS

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        from omni_plugins_mooncake.testing import loopback_environment

        loopback_environment()
        rendezvous = scratch / "rendezvous"
        rendezvous.mkdir(mode=0o700, exist_ok=True)
        return {"rendezvous_dir": str(rendezvous), "pool_size": 4 * max_bytes + (64 << 20)}

    def raw_baseline(self, config: MooncakeTEConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_mooncake.baseline import TERaw
        from omni_plugins_mooncake.testing import loopback_environment

        loopback_environment()
        return TERaw(max_bytes)

    def floor_baseline(self, config: MooncakeTEConfig, max_bytes: int, producer: bool) -> RawBaseline:
        from omni_plugins_mooncake.baseline import TEFloor
        from omni_plugins_mooncake.testing import loopback_environment

        loopback_environment()
        return TEFloor(max_bytes, producer)
