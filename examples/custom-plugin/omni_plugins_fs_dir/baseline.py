"""The 'fs-dir' raw baseline: the same bytes as one plain file, written and renamed, read and deleted.

What the connector costs is measured against it: the connector adds the wire codec, the claim
rename and its own bookkeeping. ``omni-plugins bench`` runs the producer's end and the
consumer's end in two processes.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import torch

TIMEOUT_S = 30.0


class FileRaw:
    """One end of the baseline (:class:`omni_plugins.services.RawBaseline`)."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = directory

    def handshake(self) -> Mapping[str, Any]:
        return {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        return None

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, "raw-" + key.encode("utf-8").hex())

    def put(self, key: str, payload: torch.Tensor) -> None:
        tmp = os.path.join(self.directory, f".tmp-raw-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(memoryview(payload.numpy()))
        os.replace(tmp, self._path(key))

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        path = self._path(key)
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # the producer renamed the file before the consumer is asked: the first open finds it
            try:
                with open(path, "rb") as f:
                    out = torch.empty(nbytes, dtype=torch.uint8)
                    f.readinto(memoryview(out.numpy()))
                os.unlink(path)
                return out
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(key) from None
                time.sleep(0.0005)

    def close(self) -> None:
        return None
