"""``served-dir``: one file per payload in the directory the server at ``address`` names."""

from __future__ import annotations

import os
import urllib.parse
import uuid
from typing import Any

from omni_plugins import wire
from omni_plugins.backoff import Backoff
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.settings import ConnectorSettings
from omni_test_served.server import ask


class ServedDirConfig(ConnectorSettings):
    address: str = "127.0.0.1:1"
    #: a put is on disk before it returns (the bench variant "durable")
    fsync: bool = False


def file_name(key: str) -> str:
    return "k-" + urllib.parse.quote(key, safe="")


class ServedDirConnector(Connector):
    capabilities = Capabilities(blocking_get=True, cross_process=True, consume_on_get=True)
    config_model = ServedDirConfig

    def __init__(self, config: ServedDirConfig) -> None:
        super().__init__()
        self.config = config
        self.directory = ask(config.address)

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        blob = wire.encode(data).to_bytes()
        tmp = os.path.join(self.directory, f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(blob)
            if self.config.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, file_name(key)))
        return PutResult(True, len(blob))

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        backoff = Backoff.within(timeout or 0.0, 0.001, 0.02)
        while True:
            claim = os.path.join(self.directory, f".claim-{uuid.uuid4().hex}")
            try:
                os.rename(os.path.join(self.directory, file_name(key)), claim)
            except FileNotFoundError:
                if not backoff.sleep():
                    return None
                continue
            with open(claim, "rb") as f:
                blob = f.read()
            os.unlink(claim)
            return GetResult(wire.decode(blob, copy=True), len(blob))

    def _cleanup(self, key: str) -> bool:
        try:
            os.unlink(os.path.join(self.directory, file_name(key)))
            return True
        except FileNotFoundError:
            return False

    def _health(self) -> dict[str, Any]:
        try:
            ask(self.config.address, timeout=2.0)
        except OSError as exc:
            return {"ok": False, "error": f"server {self.config.address} unreachable: {exc}"}
        return {"directory": self.directory}
