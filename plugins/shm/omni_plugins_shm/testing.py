"""Helpers for tests and benchmarks in any area (runtime, soak, examples).

Leak check: ``assert_namespace_empty(ns)`` raises ``AssertionError`` listing what is left.
"""

from __future__ import annotations

import os
import uuid

from omni_plugins_shm.gc import DEFAULT_SHM_DIR
from omni_plugins_shm.naming import namespace_prefix


def namespace_segments(namespace: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Names of every file of ``namespace`` in ``shm_dir`` (segments and liveness markers), sorted."""
    prefix = namespace_prefix(namespace)
    try:
        return sorted(name for name in os.listdir(shm_dir) if name.startswith(prefix))
    except FileNotFoundError:
        return []


def assert_namespace_empty(namespace: str, shm_dir: str = DEFAULT_SHM_DIR) -> None:
    """Fail if any file of ``namespace`` remains in ``shm_dir`` (call after closing every connector)."""
    left = namespace_segments(namespace, shm_dir)
    assert not left, f"shm namespace {namespace!r} leaked {len(left)} file(s) in {shm_dir}: {left[:10]}"


def unique_namespace(prefix: str = "t") -> str:
    """A fresh namespace name for one test (valid for ``ShmConfig.namespace``)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def shm_config(namespace: str, **overrides: object) -> dict[str, object]:
    """A config dict for ``create_connector("shm", ...)`` in ``namespace``."""
    return {"namespace": namespace, **overrides}
