"""The Mooncake raw baselines: the store's zero-copy API, and a Transfer Engine one-sided read.

``StoreRaw``: ``upsert_from`` / ``get_into`` with registered buffers, each end its own store client.
``TERaw``: what ``mooncake-te`` does underneath, without the connector: the consumer reads the
producer's registered buffer with ``transfer_sync_read`` (the handshake carries its segment and address).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from omni_plugins_mooncake.config import MooncakeStoreConfig

TIMEOUT_S = 30.0


class StoreRaw:
    """One end of the store baseline (:class:`omni_plugins.services.RawBaseline`)."""

    def __init__(self, config: MooncakeStoreConfig, max_bytes: int, producer: bool) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        segment = max_bytes * 2 + (64 << 20) if producer else 0
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", config.master_address)
        if rc != 0:
            raise RuntimeError(f"mooncake store setup failed: {rc}")
        self.buf = torch.zeros(max_bytes, dtype=torch.uint8)
        self.store.register_buffer(self.buf.data_ptr(), max_bytes)

    def handshake(self) -> Mapping[str, Any]:
        return {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        return None

    def put(self, key: str, payload: torch.Tensor) -> None:
        n = payload.numel()
        self.buf[:n].copy_(payload)
        rc = self.store.upsert_from(f"rawbench-{key}", self.buf.data_ptr(), n)
        if rc != 0:
            raise RuntimeError(f"upsert_from failed: {rc}")

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            got = self.store.get_into(f"rawbench-{key}", self.buf.data_ptr(), nbytes)
            if got == nbytes:
                self.store.remove(f"rawbench-{key}", True)
                return self.buf[:nbytes].clone()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key}: {got}")
            time.sleep(0.0005)

    def close(self) -> None:
        self.store.unregister_buffer(self.buf.data_ptr())
        self.store.close()


class TERaw:
    """One end of the Transfer Engine baseline (:class:`omni_plugins.services.RawBaseline`)."""

    def __init__(self, max_bytes: int) -> None:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize failed: {rc}")
        self.buf = torch.zeros(max_bytes, dtype=torch.uint8)
        self.te.register_memory(self.buf.data_ptr(), max_bytes)
        self.peer: Mapping[str, Any] = {}

    def handshake(self) -> Mapping[str, Any]:
        return {"segment": f"127.0.0.1:{self.te.get_rpc_port()}", "ptr": self.buf.data_ptr()}

    def connect(self, peer: Mapping[str, Any]) -> None:
        self.peer = peer

    def put(self, key: str, payload: torch.Tensor) -> None:
        self.buf[: payload.numel()].copy_(payload)

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        rc = self.te.transfer_sync_read(self.peer["segment"], self.buf.data_ptr(), self.peer["ptr"], nbytes)
        if rc != 0:
            raise RuntimeError(f"transfer_sync_read failed: {rc}")
        return self.buf[:nbytes].clone()

    def close(self) -> None:
        self.te.unregister_memory(self.buf.data_ptr())
