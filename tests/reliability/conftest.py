"""Fixtures for the reliability suite: private servers from the plugins' launchers, leak checks.

Servers come from ``omni_plugins_redis.testing`` and ``omni_plugins_mooncake.testing``
(the plugin owners' launchers); this suite adds nothing but orchestration. Every
fixture stops what it started by pid, and the session checks no child survived.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rel_pipeline import STARTED, track


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes() -> Iterator[None]:
    yield
    alive = []
    for pid in STARTED:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    assert alive == [], f"processes started by tests/reliability still running: {alive}"


@pytest.fixture
def shm_namespace() -> Iterator[str]:
    """A fresh shm namespace; asserts nothing of it is left after the test."""
    from omni_plugins_shm.testing import assert_namespace_empty, unique_namespace

    ns = unique_namespace("rel")
    yield ns
    assert_namespace_empty(ns)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[object]:
    from omni_plugins_redis.testing import RedisServer

    with RedisServer() as server:
        track(server.pid)
        yield server
