"""The 'fs-dir' connector: one file per payload, atomic rename on both ends.

* ``put``: encode with :mod:`omni_plugins.wire`, write ``.tmp-<uuid>`` (mode 0600),
  ``os.replace`` it to the key's file name -- readers never see a partial file.
* ``get``: ``os.rename`` the key's file to ``.claim-<uuid>`` -- of several readers exactly
  one wins -- then read, delete and decode (an owned copy: nothing refers to the file).
* ``cleanup``: delete the key's file. ``close``: delete this instance's stray temp files.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any

from omni_plugins import wire
from omni_plugins.backoff import Backoff
from omni_plugins.contract import Capabilities, Connector, GetResult, PutResult
from omni_plugins.errors import ConnectorError
from omni_plugins_fs_dir.config import FsDirConfig

#: every payload file's name starts with this
PAYLOAD_PREFIX = "k-"
_MAX_SLEEP = 0.05


def file_name(key: str) -> str:
    """A safe file name for any key: ``k-`` and the key's UTF-8 in hex (keys over 100 bytes: ``k-h`` and their SHA-256)."""
    raw = key.encode("utf-8")
    return PAYLOAD_PREFIX + (raw.hex() if len(raw) <= 100 else "h" + hashlib.sha256(raw).hexdigest())


class FsDirConnector(Connector):
    """Payloads as files in ``config.directory``."""

    capabilities = Capabilities(blocking_get=True, cross_process=True, cross_host=False, zero_copy_get=False, consume_on_get=True)
    #: the settings model when the class is named by import path ('omni_plugins_fs_dir.connector:FsDirConnector')
    config_model = FsDirConfig

    def __init__(self, config: FsDirConfig) -> None:
        super().__init__()
        self.config = config
        self.directory = config.directory
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._tag = uuid.uuid4().hex[:12]

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, file_name(key))

    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult:
        encoded = wire.encode(data)
        tmp = os.path.join(self.directory, f".tmp-{self._tag}-{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                for buf in encoded.buffers():
                    f.write(buf)
            os.replace(tmp, self._path(key))
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise ConnectorError(f"fs-dir connector (directory {self.directory}): put of key {key!r} failed: {exc}") from exc
        return PutResult(True, encoded.nbytes)

    def _claim(self, key: str) -> bytearray | None:
        claim = os.path.join(self.directory, f".claim-{self._tag}-{uuid.uuid4().hex}")
        try:
            os.rename(self._path(key), claim)
        except FileNotFoundError:
            return None
        try:
            size = os.path.getsize(claim)
            if size > self.config.max_payload_bytes:
                raise ConnectorError(f"fs-dir connector: payload of key {key!r} is {size} bytes, over max_payload_bytes")
            buf = bytearray(size)
            with open(claim, "rb") as f:
                f.readinto(buf)
            return buf
        finally:
            os.unlink(claim)

    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None:
        backoff = Backoff.within(timeout or 0.0, self.config.poll_interval, max(_MAX_SLEEP, self.config.poll_interval))
        while True:
            self._check_open()
            buf = self._claim(key)
            if buf is not None:
                return GetResult(wire.decode(buf, copy=False), len(buf))  # tensors are views over our private buffer
            if not backoff.sleep():
                return None

    def _cleanup(self, key: str) -> bool:
        try:
            os.unlink(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def _health(self) -> dict[str, Any]:
        try:
            files = [n for n in os.listdir(self.directory) if n.startswith(PAYLOAD_PREFIX)]
        except OSError as exc:
            return {"ok": False, "directory": self.directory, "error": str(exc)}
        # 'staged': payloads put and not yet read (any producer's); after a run, omni-plugins run reports them as leaks
        return {"directory": self.directory, "staged": len(files)}

    def _close(self) -> None:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for n in names:
            if n.startswith((f".tmp-{self._tag}-", f".claim-{self._tag}-")):
                try:
                    os.unlink(os.path.join(self.directory, n))
                except OSError:
                    pass
