"""No pickle on any wire code path; views share memory, copies do not; read-only buffers work."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_plugins import wire
from omni_plugins.testing.nopickle import BLOCK_PICKLE_SOURCE
from omni_plugins.wire import decode, encode

WIRE_DIR = Path(wire.__file__).parent
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "copyreg", "joblib"}

NO_PICKLE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys, types

    # Third-party dependencies import pickle themselves (numpy does at import time), so they
    # are loaded first; from then on pickle is poisoned and cannot be (re)imported.
    import msgpack, numpy, torch  # noqa: F401
    assert not any(m == "omni_plugins.wire" or m.startswith("omni_plugins.wire.") for m in sys.modules)


    # <block-pickle>

    from omni_plugins import wire

    payload = {
        "t": torch.randn(4, 3), "bf": torch.ones(2, dtype=torch.bfloat16), "f8": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "n": numpy.arange(6).reshape(2, 3), "nested": [1, 2.5, "s", b"b", None, True, (1, (2,))], "big": b"z" * 10000,
    }
    enc = wire.encode(payload)
    data = enc.to_bytes()
    assert b"".join(enc.buffers()) == data
    dest = bytearray(enc.nbytes)
    enc.write_into(dest)
    for copy in (False, True):
        out = wire.decode(dest, copy=copy)
        assert torch.equal(out["t"], payload["t"]) and out["nested"] == payload["nested"] and out["big"] == payload["big"]
        assert torch.equal(out["bf"], payload["bf"]) and (out["n"] == payload["n"]).all()
    assert wire.peek_nbytes(data[: wire.PREFIX_SIZE]) == len(data)
    try:
        wire.decode(data[:-1])
    except wire.WireFormatError:
        pass
    try:
        wire.encode(object())
    except wire.WireFormatError:
        pass
    for name, module in list(sys.modules.items()):
        if name.startswith("omni_plugins.wire"):
            assert not any(isinstance(v, Poisoned) for v in vars(module).values()), name
    print("NO-PICKLE OK")
    """
).replace("# <block-pickle>", BLOCK_PICKLE_SOURCE)

# Runs after NO_PICKLE_SCRIPT in the same fresh process: torch's one-time "not writable"
# warning has not been consumed yet, and every warning is an error.
READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("error")
    data = wire.encode({"t": torch.arange(5), "bf": torch.ones(2, dtype=torch.bfloat16), "n": numpy.ones(3)}).to_bytes()
    for _ in range(3):
        out = wire.decode(data)
        assert out["t"].tolist() == [0, 1, 2, 3, 4] and out["bf"].dtype == torch.bfloat16
        assert not out["n"].flags.writeable
        out = wire.decode(memoryview(data), copy=True)
        out["t"][0] = 9
        assert out["n"].flags.writeable
    print("READ-ONLY OK")
    """
)


@pytest.fixture(scope="module")
def fresh_process_report() -> str:
    """Run NO_PICKLE_SCRIPT then READ_ONLY_SCRIPT in one fresh interpreter (importing torch is slow)."""
    proc = subprocess.run([sys.executable, "-c", NO_PICKLE_SCRIPT + READ_ONLY_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_round_trip_with_pickle_blocked(fresh_process_report: str) -> None:
    assert "NO-PICKLE OK" in fresh_process_report


def test_read_only_buffers_decode_without_warnings(fresh_process_report: str) -> None:
    assert "READ-ONLY OK" in fresh_process_report


def test_wire_sources_never_import_pickle_or_load_objects() -> None:
    for path in sorted(WIRE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            assert not names & FORBIDDEN_MODULES, f"{path.name}:{node.lineno} imports {names & FORBIDDEN_MODULES}"
            if isinstance(node, ast.Attribute) and node.attr in {"load", "loads", "__reduce__", "__reduce_ex__"}:
                raise AssertionError(f"{path.name}:{node.lineno} uses .{node.attr}")
            if isinstance(node, ast.Name) and node.id in {"eval", "exec", "__import__"}:
                raise AssertionError(f"{path.name}:{node.lineno} uses {node.id}")


def test_views_share_memory_with_buffer_and_copies_do_not() -> None:
    payload = {"t": torch.arange(16, dtype=torch.float32), "bf": torch.ones(4, dtype=torch.bfloat16), "n": np.arange(8, dtype=np.int32)}
    buf = bytearray(encode(payload).to_bytes())
    base = np.frombuffer(buf, dtype=np.uint8)
    view = decode(buf)
    owned = decode(buf, copy=True)
    for key in ("t", "bf"):
        addr = view[key].data_ptr()
        assert base.ctypes.data <= addr < base.ctypes.data + len(buf)
        assert not base.ctypes.data <= owned[key].data_ptr() < base.ctypes.data + len(buf)
    assert np.shares_memory(view["n"], base) and not np.shares_memory(owned["n"], base)
    view["t"][0] = 42.0  # writable buffer -> writes land in the buffer
    assert decode(buf)["t"][0].item() == 42.0
    assert owned["t"][0].item() == 0.0
    owned["t"][1] = -1.0
    assert decode(buf)["t"][1].item() == 1.0


def test_decoded_views_keep_the_buffer_alive() -> None:
    out = decode(bytearray(encode(torch.arange(1000, dtype=torch.int64)).to_bytes()))
    import gc

    gc.collect()
    assert out.sum().item() == sum(range(1000))


def test_large_copies_are_owned_writable_and_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    """decode(copy=True) of buffers above the huge-page threshold (mmap-backed output)."""
    from omni_plugins.wire import _alloc

    monkeypatch.setattr(_alloc, "HUGE_THRESHOLD", 4 << 20)  # exercise the mmap path with small buffers
    t = torch.arange(_alloc.HUGE_THRESHOLD // 4 + 3, dtype=torch.float32)
    a = np.arange(_alloc.HUGE_THRESHOLD // 8 + 1, dtype=np.float64).reshape(-1, 1)
    buf = bytearray(encode({"t": t, "a": a}).to_bytes())
    out = decode(buf, copy=True)
    assert torch.equal(out["t"], t) and np.array_equal(out["a"], a)
    assert out["a"].shape == a.shape and out["a"].flags.writeable and out["a"].flags.c_contiguous
    buf[:] = bytes(len(buf))  # wiping the source does not touch the copies
    assert torch.equal(out["t"], t) and np.array_equal(out["a"], a)
    out["t"] += 1
    assert out["t"][0].item() == 1.0
    del out  # the mappings are released with the last reference
