"""Fixtures: real ``mooncake_master`` processes on loopback, and leak checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from omni_plugins_mooncake.testing import MooncakeMaster, loopback_environment

loopback_environment()

SEGMENT = "256MiB"


def store_config(master: MooncakeMaster, **extra: object) -> dict[str, object]:
    """A small loopback store config for tests."""
    return {"master_address": master.address, "global_segment_size": SEGMENT, "local_buffer_size": "16MiB", **extra}


def count_objects(master: MooncakeMaster) -> int:
    """Objects the master still holds (removes them: call at the end of a test)."""
    from mooncake.store import MooncakeDistributedStore

    probe = MooncakeDistributedStore()
    assert probe.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        return int(probe.remove_all(True))
    finally:
        probe.close()


@pytest.fixture(autouse=True)
def private_rendezvous(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own ``XDG_RUNTIME_DIR`` (its child processes get it too), so its own default ``mooncake-te``
    rendezvous directory: tests running at once (pytest-xdist workers) never find each other's producers."""
    runtime = tmp_path_factory.mktemp("xdg-runtime")
    runtime.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"mooncake_master pid {pid} still running"


@pytest.fixture(scope="session")
def master(omni_server: Callable[[str], MooncakeMaster]) -> Iterator[MooncakeMaster]:
    """One master shared by the session's tests: the plugin's private server (``omni_server``); tests that kill one use ``own_master``."""
    m = omni_server("mooncake-store")
    yield m
    assert m.pid is not None, "a test stopped the shared master"
    leftover = count_objects(m)
    assert leftover == 0, f"{leftover} store objects left on the shared master"


@pytest.fixture
def own_master() -> Iterator[MooncakeMaster]:
    """A master this test may kill and restart."""
    m = MooncakeMaster()
    m.start()
    try:
        yield m
    finally:
        m.stop()
        _assert_gone(m.launched_pids)
