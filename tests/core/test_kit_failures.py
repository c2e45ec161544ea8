"""A plugin author's failing conformance test must say what failed, not just ``AssertionError``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TEST_FILE = textwrap.dedent(
    '''
    import threading

    import pytest

    from omni_plugins.testing import ConnectorContract


    class TestThreadUnsafe(ConnectorContract):
        cross_process = False

        @pytest.fixture
        def connector_spec(self):
            return "omni_test_unsafe.mod:Unsafe", {}


    class TestWrongSize(ConnectorContract):
        cross_process = False

        @pytest.fixture
        def connector_spec(self):
            return "omni_test_unsafe.mod:ZeroSize", {}
    '''
)

MODULE = textwrap.dedent(
    """
    import threading

    from omni_plugins.contract import PutResult
    from omni_plugins.memory import MemoryConnector


    class Unsafe(MemoryConnector):
        def _put(self, f, t, key, data):
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError("shared scratch buffer clobbered")
            return super()._put(f, t, key, data)


    class ZeroSize(MemoryConnector):
        def _put(self, f, t, key, data):
            return super()._put(f, t, key, data)._replace(size=0)
    """
)


def test_kit_failures_show_their_values(tmp_path: Path) -> None:
    pkg = tmp_path / "omni_test_unsafe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(MODULE)
    (tmp_path / "test_plugin.py").write_text(TEST_FILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-k", "eight_threads or roundtrip", "test_plugin.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failure_lines = [line for line in proc.stdout.splitlines() if line.startswith("E ")]
    # the worker threads' exceptions are in the assertion message
    assert any("RuntimeError: shared scratch buffer clobbered" in line for line in failure_lines), proc.stdout
    # the kit's plain asserts are rewritten: the values are shown (size=0 of the PutResult)
    assert any("size=0" in line for line in failure_lines), proc.stdout
