"""Fixtures for the security suite: private servers from the plugins' launchers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def redis_server() -> Iterator[Any]:
    from omni_plugins_redis.testing import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def shm_namespace() -> Iterator[str]:
    """A fresh shm namespace; asserts nothing of it is left after the test."""
    from omni_plugins_shm.testing import assert_namespace_empty, unique_namespace

    ns = unique_namespace("sec")
    yield ns
    assert_namespace_empty(ns)
