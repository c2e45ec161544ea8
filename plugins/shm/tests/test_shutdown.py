"""A connector closed at interpreter shutdown (from a ``__del__``, as vLLM-Omni's connectors close) frees everything."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from omni_plugins_shm.testing import namespace_segments

# The holder module stays alive into the interpreter's last teardown phase, as modules of a large framework do
# (a C extension keeps a reference); there the globals of every module still alive, this plugin's included, are
# cleared before the holder's __del__ runs. Nothing here depends on timing: the order is CPython's.
SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, types

    holder = types.ModuleType("holder")
    sys.modules["holder"] = holder
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(holder))

    import torch
    import omni_plugins
    from omni_plugins_shm import slots, wakeslots

    class ClosesOnDel:
        def __init__(self, connector):
            self.connector = connector
            self.modules = (slots, wakeslots)  # kept alive into the same phase
        def __del__(self):
            self.connector.close()

    conn = omni_plugins.create_connector("shm", {{"namespace": "{namespace}", "pool_bytes": 1 << 20}})
    conn.put("0", "1", "small", {{"x": torch.ones(4)}})            # a slot of the slot table
    conn.put("0", "1", "large", {{"x": torch.ones(64 << 10)}})     # a published segment
    holder.closer = ClosesOnDel(conn)
    del conn
    if sys.argv[1] == "crash":
        raise RuntimeError("crash")
    """
)


@pytest.mark.parametrize("ending", ["exit", "crash"])
def test_close_from_del_at_interpreter_shutdown_frees_the_namespace(namespace: str, ending: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(namespace=namespace), ending], capture_output=True, text=True, timeout=120)
    assert out.returncode == (1 if ending == "crash" else 0), out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr
    assert namespace_segments(namespace) == []
