"""Per-backend bench drivers: the connector's config and a raw baseline on the same backend.

A driver runs in two processes. The producer (parent) puts a payload under a
key; the consumer (child) gets it and owns a copy. ``raw`` uses the backend's
own client the fastest plain way (no codec, no protocol of ours); ``omni``
uses the connector (``put`` / blocking ``get``, wire-encoded tensors).
Drivers are created in each process from a picklable :class:`DriverSpec`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DriverSpec:
    """Which backend, how to reach it, the connector config and the largest payload."""

    backend: str
    connector: str
    config: dict[str, Any]
    max_bytes: int
    params: dict[str, Any] = field(default_factory=dict)


class RawEnd(Protocol):
    """One end of a raw baseline. ``handshake`` data crosses to the other end once at start."""

    def handshake(self) -> dict[str, Any]: ...

    def connect(self, peer: dict[str, Any]) -> None: ...

    def put(self, key: str, payload: torch.Tensor) -> None: ...

    def get(self, key: str, nbytes: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class ShmRaw:
    """A reused ``multiprocessing.shared_memory`` segment: copy in, copy out (two copies, no codec)."""

    def __init__(self, spec: DriverSpec, producer: bool) -> None:
        from multiprocessing import shared_memory

        self._shm_mod = shared_memory
        self.producer = producer
        self.seg: Any = shared_memory.SharedMemory(create=True, size=spec.max_bytes) if producer else None

    def handshake(self) -> dict[str, Any]:
        return {"name": self.seg.name} if self.producer else {}

    def connect(self, peer: dict[str, Any]) -> None:
        if not self.producer:
            # spawned children share the parent's resource tracker, which unlinks the segment once, at the producer's close
            self.seg = self._shm_mod.SharedMemory(name=peer["name"])

    def put(self, key: str, payload: torch.Tensor) -> None:
        n = payload.numel()
        torch.frombuffer(self.seg.buf, dtype=torch.uint8, count=n).copy_(payload)

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.copy_(torch.frombuffer(self.seg.buf, dtype=torch.uint8, count=nbytes))
        return out

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            if self.producer:
                self.seg.unlink()


class RedisRaw:
    """redis-py ``SET`` / ``GETDEL`` of the raw bytes (hiredis parser)."""

    def __init__(self, spec: DriverSpec, producer: bool) -> None:
        import redis

        self.client = redis.Redis.from_url(spec.params["url"], socket_timeout=TIMEOUT_S)

    def handshake(self) -> dict[str, Any]:
        return {}

    def connect(self, peer: dict[str, Any]) -> None:
        return None

    def put(self, key: str, payload: torch.Tensor) -> None:
        self.client.set(f"rawbench:{key}", payload.numpy().tobytes())

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            data: Any = self.client.getdel(f"rawbench:{key}")
            if data is not None:
                return torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if time.monotonic() > deadline:
                raise TimeoutError(key)

    def close(self) -> None:
        self.client.close()


class StoreRaw:
    """Mooncake store ``upsert_from`` / ``get_into`` with registered buffers (its zero-copy API)."""

    def __init__(self, spec: DriverSpec, producer: bool) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        seg = spec.max_bytes * 2 + (64 << 20) if producer else 0
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", seg, 16 << 20, "tcp", "", spec.params["master"])
        if rc != 0:
            raise RuntimeError(f"mooncake store setup failed: {rc}")
        self.buf = torch.zeros(spec.max_bytes, dtype=torch.uint8)
        self.store.register_buffer(self.buf.data_ptr(), spec.max_bytes)

    def handshake(self) -> dict[str, Any]:
        return {}

    def connect(self, peer: dict[str, Any]) -> None:
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
    """Mooncake TransferEngine one-sided read of the producer's registered buffer (what ``mooncake-te`` does underneath)."""

    def __init__(self, spec: DriverSpec, producer: bool) -> None:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize failed: {rc}")
        self.buf = torch.zeros(spec.max_bytes, dtype=torch.uint8)
        self.te.register_memory(self.buf.data_ptr(), spec.max_bytes)
        self.peer: dict[str, Any] = {}

    def handshake(self) -> dict[str, Any]:
        return {"segment": f"127.0.0.1:{self.te.get_rpc_port()}", "ptr": self.buf.data_ptr()}

    def connect(self, peer: dict[str, Any]) -> None:
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


RAW: dict[str, type] = {"shm": ShmRaw, "redis": RedisRaw, "mooncake-store": StoreRaw, "mooncake-te": TERaw}


def make_raw(spec: DriverSpec, producer: bool) -> RawEnd:
    end: RawEnd = RAW[spec.backend](spec, producer)
    return end
