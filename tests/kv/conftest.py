"""Fixtures of the KV transfer tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

import omni_plugins
from omni_plugins.memory import MemoryConnector


@pytest.fixture
def memory_namespace() -> str:
    return f"kv-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def memory_connector(memory_namespace: str) -> Iterator[MemoryConnector]:
    """A ``memory`` connector in a fresh namespace; the test fails if keys remain after it."""
    conn = omni_plugins.create_connector("memory", {"namespace": memory_namespace})
    assert isinstance(conn, MemoryConnector)
    yield conn
    if not conn.closed:
        conn.close()
