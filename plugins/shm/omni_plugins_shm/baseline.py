"""The shm raw baseline: one reused ``multiprocessing.shared_memory`` segment, copy in, copy out.

Two copies and no codec: what any pair of processes sharing memory pays at least. The producer
creates the segment and tells the consumer its name in the handshake; the consumer's ``get``
returns a fresh tensor (a copy it owns), as the connector's ``get`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from multiprocessing import shared_memory
from typing import Any

import torch


class ShmRaw:
    """One end of the baseline (:class:`omni_plugins.services.RawBaseline`)."""

    def __init__(self, max_bytes: int, producer: bool) -> None:
        self.producer = producer
        self.seg: shared_memory.SharedMemory | None = shared_memory.SharedMemory(create=True, size=max_bytes) if producer else None

    def handshake(self) -> Mapping[str, Any]:
        return {"name": self.seg.name} if self.seg is not None and self.producer else {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        if not self.producer:
            # a spawned child shares the parent's resource tracker, which unlinks the segment once, at the producer's close
            self.seg = shared_memory.SharedMemory(name=peer["name"])

    def _buf(self) -> memoryview:
        buf = self.seg.buf if self.seg is not None else None
        if buf is None:
            raise RuntimeError("shm baseline used before connect() or after close()")
        return buf

    def put(self, key: str, payload: torch.Tensor) -> None:
        torch.frombuffer(self._buf(), dtype=torch.uint8, count=payload.numel()).copy_(payload)

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        out.copy_(torch.frombuffer(self._buf(), dtype=torch.uint8, count=nbytes))
        return out

    def close(self) -> None:
        if self.seg is not None:
            self.seg.close()
            if self.producer:
                self.seg.unlink()
            self.seg = None
