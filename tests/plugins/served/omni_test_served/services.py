"""Every service, for ``served-dir``: census and reclaim of a run's files, the server, bench config, raw baseline, preload."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omni_plugins.bench.targets import SizeTarget
from omni_plugins.ports import free_port
from omni_plugins.services import ConnectorServices, Finding, PrivateServer, RawBaseline, RunScope, ServiceUnavailable
from omni_test_served.connector import ServedDirConfig
from omni_test_served.server import ask

VARIABLE = "OMNI_TEST_SERVED"


class ServedServer:
    """The running ``omni_test_served.server`` process and its directory."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="omni-served-")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("server.py")), str(self.port), self.directory], stdout=subprocess.PIPE
        )
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != b"ready":
            self.stop()
            raise ServiceUnavailable("the served-dir server did not start")

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        return {"address": self.address, **overrides}

    def stop(self) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _run_files(config: ServedDirConfig, run: RunScope) -> tuple[str, list[str]]:
    directory = ask(config.address)
    start = "k-" + urllib.parse.quote(run.request_prefix, safe="")
    return directory, sorted(n for n in os.listdir(directory) if n.startswith(start))


class FileRaw:
    """The raw baseline: the bytes as a plain file, written and read; the floor also renames it twice (claims)."""

    def __init__(self, directory: str, claims: bool = False) -> None:
        self.directory = directory
        self.claims = claims

    def handshake(self) -> Mapping[str, Any]:
        return {}

    def connect(self, peer: Mapping[str, Any]) -> None:
        return None

    def put(self, key: str, payload: torch.Tensor) -> None:
        with open(os.path.join(self.directory, "raw-" + key), "wb") as f:
            f.write(payload.numpy().tobytes())

    def get(self, key: str, nbytes: int) -> torch.Tensor:
        path = os.path.join(self.directory, "raw-" + key)
        if self.claims:
            claimed = path + ".claimed"
            os.rename(path, claimed)
            path = claimed
        with open(path, "rb") as f:
            data = bytearray(f.read())
        os.unlink(path)
        return torch.frombuffer(data, dtype=torch.uint8)

    def close(self) -> None:
        return None


class ServedDirServices(ConnectorServices[ServedDirConfig]):
    preload = ("omni_test_served.connector",)
    server_variables = {VARIABLE: "127.0.0.1:1"}
    bench_variants = {"durable": {"fsync": True}}
    bench_targets = (
        SizeTarget("put + get within 50x a plain file", "cost", 50.0),
        SizeTarget("durable put within 500x", "cost", 500.0, variant="durable"),
    )

    def census(self, config: ServedDirConfig, run: RunScope) -> Finding:
        directory, files = _run_files(config, run)
        return Finding(len(files), "served file(s) of this run", f"in {directory}", tuple(files[:5]))

    def reclaim(self, config: ServedDirConfig, run: RunScope) -> Finding:
        directory, files = _run_files(config, run)
        for name in files:
            os.unlink(os.path.join(directory, name))
        return Finding(len(files), "served file(s) of this run")

    def start_server(self) -> PrivateServer:
        return ServedServer()

    def server_environment(self, server: PrivateServer) -> Mapping[str, str]:
        return {VARIABLE: server.address}

    def bench_config(self, max_bytes: int, server: PrivateServer | None, scratch: Path) -> dict[str, Any]:
        if server is None:
            raise ServiceUnavailable("served-dir needs its server")
        return server.connector_config()

    def raw_baseline(self, config: ServedDirConfig, max_bytes: int, producer: bool) -> RawBaseline:
        return FileRaw(ask(config.address))

    def floor_baseline(self, config: ServedDirConfig, max_bytes: int, producer: bool) -> RawBaseline:
        return FileRaw(ask(config.address), claims=True)
