"""Fixtures for the shm connector tests: a unique namespace per test and leak checks.

Every test gets its own namespace ``tshm<session>-<n>``; after each test the
namespace must be empty, and after the session nothing with the session's
prefix may remain in /dev/shm.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from omni_plugins_shm.naming import PREFIX
from omni_plugins_shm.testing import assert_namespace_empty

from omni_plugins import create_connector
from omni_plugins.testing.processes import process_context

SESSION = uuid.uuid4().hex[:8]
_counter = itertools.count()


@pytest.fixture(scope="session", autouse=True)
def _no_shm_leftovers_after_session() -> Iterator[None]:
    yield
    prefix = f"{PREFIX}.tshm{SESSION}-"
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    assert not left, f"shm tests left {len(left)} file(s) in /dev/shm: {left[:10]}"


@pytest.fixture
def namespace() -> Iterator[str]:
    """A fresh namespace; the test fails if anything of it is left in /dev/shm afterwards."""
    ns = f"tshm{SESSION}-{next(_counter)}"
    yield ns
    assert_namespace_empty(ns)


@pytest.fixture
def pair(namespace: str) -> Iterator[tuple[Any, Any]]:
    """A producer and a consumer shm connector on the test's namespace, closed afterwards."""
    producer = create_connector("shm", {"namespace": namespace})
    consumer = create_connector("shm", {"namespace": namespace})
    yield producer, consumer
    producer.close()
    consumer.close()


@pytest.fixture
def file_pair(namespace: str) -> Iterator[tuple[Any, Any]]:
    """Like ``pair`` with the slot table off (``slot_count=0``): for tests of the file path's segments."""
    producer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    consumer = create_connector("shm", {"namespace": namespace, "slot_count": 0})
    yield producer, consumer
    producer.close()
    consumer.close()


@pytest.fixture
def spawn():  # type: ignore[no-untyped-def]
    """Starts child processes (forkserver with torch and the plugins preloaded: see omni_plugins.testing.processes)."""
    return process_context()
