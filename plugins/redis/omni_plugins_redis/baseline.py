"""The Redis raw baseline: redis-py ``SET`` of the raw bytes by the producer, ``GETDEL`` by the consumer.

Each end has its own client (hiredis parser when installed): the fastest plain way to move the
bytes through the server, no codec and no protocol of ours.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from omni_plugins_redis.admin import TIMEOUT_S, plain_client

if TYPE_CHECKING:
    from omni_plugins_redis.config import RedisConfig


class RedisRaw:
    """One end of the baseline (:class:`omni_plugins.services.RawBaseline`), keys under the config's ``key_prefix``."""

    def __init__(self, config: RedisConfig) -> None:
        self.client = plain_client(config)
        self.prefix = f"{config.key_prefix}rawbench:"

    def handshake(self) -> Mapping[str, Any]:
        return {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        return None

    def put(self, key: str, payload: torch.Tensor) -> None:
        self.client.set(self.prefix + key, payload.numpy().tobytes())

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # the producer acked its SET before the consumer is asked: the first GETDEL finds it
            data: Any = self.client.getdel(self.prefix + key)
            if data is not None:
                return torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if time.monotonic() > deadline:
                raise TimeoutError(key)

    def close(self) -> None:
        self.client.close()
