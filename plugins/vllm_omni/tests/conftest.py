"""Fixtures of the plugin's tests; the integration tests run in the integration venv (``bash scripts/setup.sh vllm-omni``).

Without vLLM-Omni installed only the unit tests here run; the others skip. With it, one fresh
vLLM-Omni stage process is started as soon as this file is imported, so its ~20 s import overlaps
the test process's own; every test that needs a second process uses it.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # vo_helpers

HAVE_VLLM_OMNI = importlib.util.find_spec("vllm_omni") is not None
SESSION = uuid.uuid4().hex[:8]
_counter = itertools.count()

_stage: Any = None
if HAVE_VLLM_OMNI:
    from omni_plugins_vllm_omni.testing import StageProcess

    _stage = StageProcess()


@pytest.fixture(scope="session", autouse=True)
def _vllm_omni_plugins_loaded() -> None:
    """The test process starts as a vLLM-Omni process does: its general plugins loaded (ours among them)."""
    if HAVE_VLLM_OMNI:
        from vllm_omni.plugins import load_omni_general_plugins

        load_omni_general_plugins()


@pytest.fixture(scope="session")
def stage() -> Iterator[Any]:
    """The fresh vLLM-Omni stage process (see ``omni_plugins_vllm_omni.testing.StageProcess``)."""
    if _stage is None:
        pytest.skip("vLLM-Omni is not installed (bash scripts/setup.sh vllm-omni)")
    yield _stage
    _stage.close()


@pytest.fixture
def namespace() -> Iterator[str]:
    """A fresh shm namespace; the test fails if anything of it is left in /dev/shm."""
    from omni_plugins_shm.testing import assert_namespace_empty

    ns = f"tvo{SESSION}-{next(_counter)}"
    yield ns
    assert_namespace_empty(ns)


@pytest.fixture(scope="session")
def redis_server(omni_server: Any) -> Any:
    """The Redis plugin's private server (its ``start_server`` service; stopped and checked by ``omni_server``)."""
    return omni_server("redis")


@pytest.fixture
def redis_prefix(redis_server: Any) -> Iterator[str]:
    """A fresh key prefix on the session's server; the test fails if a key under it is left."""
    prefix = f"tvo{SESSION}-{next(_counter)}:"
    yield prefix
    assert redis_server.keys(prefix + "*") == [], "Redis keys left behind"


@pytest.fixture(scope="session", autouse=True)
def _no_shm_leftovers() -> Iterator[None]:
    yield
    left = sorted(n for n in os.listdir("/dev/shm") if f"tvo{SESSION}" in n)
    assert not left, f"left in /dev/shm: {left[:10]}"
