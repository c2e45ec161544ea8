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


class StoreFloor(StoreRaw):
    """The store floor: :class:`StoreRaw` plus what a connector cannot avoid, the wire encoding and a decode.

    The payload is encoded straight into the registered buffer (the one staging copy the raw
    baseline makes too), read back with one ``get_into`` of the buffer's capacity (a consumer does
    not know the encoded size) and decoded into a tensor the consumer owns.
    """

    def put(self, key: str, payload: torch.Tensor) -> None:
        from omni_plugins import wire

        n = wire.encode({"t": payload}).write_into(self.buf.numpy())
        rc = self.store.upsert_from(f"rawbench-{key}", self.buf.data_ptr(), n)
        if rc != 0:
            raise RuntimeError(f"upsert_from failed: {rc}")

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        from omni_plugins import wire

        deadline = time.monotonic() + TIMEOUT_S
        while True:
            got = int(self.store.get_into(f"rawbench-{key}", self.buf.data_ptr(), self.buf.numel()))
            if got > 0:
                self.store.remove(f"rawbench-{key}", True)
                tensor: torch.Tensor = wire.decode(self.buf.numpy().data[:got], copy=True)["t"]
                return tensor
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key}: {got}")
            time.sleep(0.0005)


class TEFloor(TERaw):
    """The Transfer Engine floor: the one-sided read of :class:`TERaw` plus one copy, one lookup and a decode.

    ``put`` encodes the payload into the registered buffer (``put`` may not keep the caller's
    memory); ``get`` asks the producer where the key is over a kept loopback TCP connection (16
    bytes there, 16 back, answered by a thread that does nothing else: the least any lookup costs),
    reads those bytes with ``transfer_sync_read`` and decodes a tensor the consumer owns.
    """

    def __init__(self, max_bytes: int, producer: bool) -> None:
        import socket
        import threading

        super().__init__(max_bytes + (64 << 10))
        self._producer = producer
        self._sock: socket.socket | None = None
        self._size = 0
        if producer:
            from omni_plugins.ports import free_port

            self._port = free_port()
            self._listener = socket.create_server(("127.0.0.1", self._port))
            self._answer = threading.Thread(target=self._serve, daemon=True, name="te-floor-lookup")
            self._answer.start()

    def _serve(self) -> None:
        import socket

        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while len(conn.recv(16, socket.MSG_WAITALL)) == 16:
                conn.sendall(self.buf.data_ptr().to_bytes(8, "little") + self._size.to_bytes(8, "little"))

    def handshake(self) -> Mapping[str, Any]:
        out = dict(super().handshake())
        if self._producer:
            out["lookup_port"] = self._port
        return out

    def connect(self, peer: Mapping[str, Any]) -> None:
        import socket

        super().connect(peer)
        if not self._producer:
            self._sock = socket.create_connection(("127.0.0.1", int(peer["lookup_port"])))
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, key: str, payload: torch.Tensor) -> None:
        from omni_plugins import wire

        self._size = wire.encode({"t": payload}).write_into(self.buf.numpy())

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        import socket

        from omni_plugins import wire

        assert self._sock is not None
        self._sock.sendall(key.encode()[:16].ljust(16, b"\0"))
        answer = self._sock.recv(16, socket.MSG_WAITALL)
        ptr, size = int.from_bytes(answer[:8], "little"), int.from_bytes(answer[8:], "little")
        rc = self.te.transfer_sync_read(self.peer["segment"], self.buf.data_ptr(), ptr, size)
        if rc != 0:
            raise RuntimeError(f"transfer_sync_read failed: {rc}")
        tensor: torch.Tensor = wire.decode(self.buf.numpy().data[:size], copy=True)["t"]
        return tensor

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._producer:
            self._listener.close()
        super().close()
