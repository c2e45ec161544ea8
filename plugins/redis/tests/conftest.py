"""Fixtures for the Redis connector tests: private servers on free loopback ports.

The shared server is the plugin's own (``omni_server("redis")``, its ``start_server`` service);
clusters come from :mod:`omni_plugins_redis.testing`. Shared servers are session-scoped (a cluster
costs ~1 s to build); every
fixture that owns a server asserts at teardown that no key under the test
prefix is left behind, and the session asserts that no redis-server it
started is still running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psutil
import pytest
from omni_plugins_redis.testing import RedisCluster, RedisServer

PREFIX = "omnitest:"

_started_pids: list[int] = []


def _track(target: RedisServer | RedisCluster) -> None:
    pids = target.pids if isinstance(target, RedisCluster) else [target.pid]
    _started_pids.extend(p for p in pids if p is not None)


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_servers() -> Iterator[None]:
    yield
    alive = []
    for pid in _started_pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and "redis" in proc.name():
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    assert alive == [], f"redis-server processes still running: {alive}"


@pytest.fixture(scope="session")
def track_server() -> object:
    """Call with a started RedisServer/RedisCluster so the session checks it was stopped."""
    return _track


@pytest.fixture(scope="session")
def prefix() -> str:
    return PREFIX


@pytest.fixture(scope="session")
def redis_server(omni_server: Callable[[str], RedisServer]) -> Iterator[RedisServer]:
    """The plugin's private server (its ``start_server`` service, through omni-plugins' ``omni_server`` fixture)."""
    server = omni_server("redis")  # the fixture checks it stops by pid
    yield server
    assert server.keys(PREFIX + "*") == [], "keys left behind on the shared server"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3) as cluster:
        _track(cluster)
        yield cluster
        assert cluster.keys(PREFIX + "*") == [], "keys left behind on the shared cluster"


@pytest.fixture
def server_config(redis_server: RedisServer) -> dict[str, object]:
    return redis_server.connector_config(key_prefix=PREFIX)


@pytest.fixture
def cluster_config(redis_cluster: RedisCluster) -> dict[str, object]:
    return redis_cluster.connector_config(key_prefix=PREFIX)
