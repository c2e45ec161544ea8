"""Fixtures for the runtime tests: unique memory namespaces, builders, fault-injecting connectors."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rt_helpers import make_runtime

from omni_plugins.runtime import consumable


@pytest.fixture
def namespace() -> str:
    return f"rt-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def _fresh_legacy_warnings() -> Iterator[None]:
    consumable.reset_legacy_warnings()
    yield
    consumable.reset_legacy_warnings()


@pytest.fixture
def runtimes(namespace: str) -> Iterator[list]:
    """A list that test code appends runtimes to; all are shut down afterwards."""
    made: list = []
    yield made
    for rt in made:
        rt.shutdown()


__all__ = ["make_runtime"]
