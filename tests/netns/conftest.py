"""Three test hosts (a, b: stage hosts; c: the service host running Redis and mooncake_master) for the module."""

from __future__ import annotations

import secrets
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_plugins.testing.netns import TestHost, TestNetwork, test_hosts_unavailable

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def network() -> Iterator[TestNetwork]:
    reason = test_hosts_unavailable()
    if reason:
        pytest.skip(reason)
    with TestNetwork(3) as net:
        yield net
    assert net.leftovers() == []


class Service:
    """A server process on a test host and how to reach it."""

    def __init__(self, host: TestHost, port: int, **extra: object) -> None:
        self.host, self.port, self.extra = host, port, extra

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"

    def master_key_count(self) -> int:
        """Objects a ``mooncake_master`` (started with a metrics port) holds now."""
        url = f"http://{self.host.address}:{self.extra['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("master_key_count "):
                    return int(float(line.split()[1]))
        raise AssertionError("mooncake_master metrics have no master_key_count")


@pytest.fixture(scope="module")
def redis_on_c(network: TestNetwork, tmp_path_factory: pytest.TempPathFactory) -> Service:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server not installed")
    c = network.host("c")
    port, password = c.free_port(), secrets.token_urlsafe(16)
    workdir = tmp_path_factory.mktemp("redis-c")
    argv = [server, "--bind", c.address, "--port", str(port), "--requirepass", password, "--save", "", "--appendonly", "no"]
    c.serve([*argv, "--dir", str(workdir), "--logfile", str(workdir / "redis.log")], port=port)
    return Service(c, port, password=password)


@pytest.fixture(scope="module")
def master_on_c(network: TestNetwork, tmp_path_factory: pytest.TempPathFactory) -> Service:
    pytest.importorskip("mooncake.store")
    from omni_plugins_mooncake.testing import find_master_binary

    c = network.host("c")
    rpc, metrics, http = c.free_port(), c.free_port(), c.free_port()
    log = open(tmp_path_factory.mktemp("master-c") / "master.log", "wb")  # noqa: SIM115 - the server writes it until the network closes
    argv = [
        find_master_binary(),
        f"--rpc_address={c.address}",
        f"--rpc_port={rpc}",
        f"--metrics_host={c.address}",
        f"--metrics_port={metrics}",
        "--default_kv_lease_ttl=500",
        "--client_ttl=30",  # a client cut off for less stays mounted: its payloads survive the partition
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={c.address}",
        f"--http_metadata_server_port={http}",
        "--enable_metric_reporting=false",
    ]
    c.serve(argv, port=rpc, stdout=log, stderr=log, env={"MC_LOG_LEVEL": "ERROR", "PATH": "/usr/bin:/bin"})
    return Service(c, rpc, metrics_port=metrics, metadata_url=f"http://{c.address}:{http}/metadata")
