"""Differential fuzzing of the compiled wire header path (``omni_plugins.wire._native``) with atheris.

Every input (built as in ``fuzz_wire.py``: raw bytes, a sealed arbitrary header, or a
mutated sample message) is decoded by the C path and by the pure-Python reference, with
``copy=False`` over read-only ``bytes`` and ``copy=True`` over a ``bytearray``. The contract:

* both raise :class:`WireFormatError` (from a named check: never the catch-all
  "malformed message", never a ``MemoryError``), or both return equal values (same
  container types, key order, dtypes, shapes, tensor bits, float bits);
* a value that decoded is re-encoded by both encoders: identical bytes, or the same
  ``WireFormatError`` message from both.

libFuzzer's coverage comes from the Python side (the reference decoder and this harness);
the C module itself is not coverage-instrumented (gcc cannot emit libFuzzer's counters),
so memory errors in it are caught by running an AddressSanitizer build of it::

    gcc -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fPIC -shared \\
        -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \\
        omni_plugins/wire/_native.c -o /tmp/asan/_native.so
    ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \\
        python benchmarks/fuzz/fuzz_wire_native.py --native-so=/tmp/asan/_native.so --as-headroom-mib=0 \\
        -max_total_time=600 -timeout=10 /tmp/corpus-native

    python benchmarks/fuzz/fuzz_wire_native.py -runs=100000 [corpus_dir]   # the built module, under RLIMIT_AS

Under ``LD_PRELOAD=libasan`` libFuzzer's coverage feedback does not work (ASan supplies the
coverage symbols), so the ASan run is best a replay-and-mutate of the guided run's corpus::

    ASAN_OPTIONS=detect_leaks=0 LD_PRELOAD=... python benchmarks/fuzz/fuzz_wire_native.py \
        --native-so=/tmp/asan/_native.so --mutate-loop=600 /tmp/corpus-native

``--native-so=PATH`` loads that build of the module instead of the installed one.
"""

from __future__ import annotations

import importlib.util
import math
import struct
import sys
from typing import Any

import atheris


def _preload_native(argv: list[str]) -> None:
    """Honour ``--native-so=PATH`` (before omni_plugins.wire picks its implementation)."""
    for arg in list(argv):
        if arg.startswith("--native-so="):
            argv.remove(arg)
            spec = importlib.util.spec_from_file_location("omni_plugins.wire._native", arg.split("=", 1)[1])
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules["omni_plugins.wire._native"] = module


_preload_native(sys.argv)

with atheris.instrument_imports(include=["omni_plugins.wire", "msgpack"]):
    from omni_plugins import wire
    from omni_plugins.errors import WireFormatError
    from omni_plugins.wire import _codec

# after the preload on purpose: fuzz_wire imports omni_plugins.wire, which picks its implementation
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _harness import run  # noqa: E402
from fuzz_wire import make_input, write_seeds  # noqa: E402

if _codec.IMPLEMENTATION != "native":
    raise SystemExit("omni_plugins.wire._native is not built (or OMNI_WIRE_PURE is set): nothing to compare")


def same(a: Any, b: Any) -> bool:
    """Deep equality that also compares types, key order, dtypes, shapes and float / tensor bits."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return a.numel() == 0 or bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def outcome(fn: Any, *args: Any, **kw: Any) -> tuple[bool, Any]:
    try:
        return True, fn(*args, **kw)
    except WireFormatError as exc:
        text = str(exc)
        if "malformed message" in text or "MemoryError" in text:
            raise AssertionError(f"decoder left a named-check path: {text}") from exc
        return False, exc


def check_encoders(value: Any) -> None:
    with _codec.use("native"):
        ok_n, got_n = outcome(lambda: wire.encode(value).to_bytes())
    with _codec.use("python"):
        ok_p, got_p = outcome(lambda: wire.encode(value).to_bytes())
    if ok_n != ok_p or (ok_n and got_n != got_p) or (not ok_n and str(got_n) != str(got_p)):
        raise AssertionError(f"encoders differ on {value!r}: native={got_n!r} python={got_p!r}")


def test_one_input(data: bytes) -> None:
    message = make_input(data)
    for copy, buffer in ((False, message), (True, bytearray(message))):
        with _codec.use("native"):
            ok_n, got_n = outcome(wire.decode, buffer, copy=copy)
        with _codec.use("python"):
            ok_p, got_p = outcome(wire.decode, buffer, copy=copy)
        if ok_n != ok_p:
            raise AssertionError(f"decoders disagree (copy={copy}): native={got_n!r} python={got_p!r}")
        if ok_n:
            if not same(got_n, got_p):
                raise AssertionError(f"decoders return different values (copy={copy}): {got_n!r} != {got_p!r}")
            check_encoders(got_n)


def mutate_loop(corpus: str, seconds: float, seed: int) -> None:
    """Without libFuzzer: mutate the corpus files (and random bytes) for ``seconds`` and check each input.

    For the AddressSanitizer run: under ``LD_PRELOAD=libasan`` libFuzzer's coverage feedback is
    broken (ASan provides the coverage symbols), so the guided run builds the corpus and this
    loop replays and mutates it with the instrumented C module.
    """
    import os
    import random
    import time

    rng = random.Random(seed)
    seeds = [b""]
    if os.path.isdir(corpus):
        for name in sorted(os.listdir(corpus)):
            with open(os.path.join(corpus, name), "rb") as f:
                seeds.append(f.read())
    for s in seeds:
        test_one_input(s)
    count, start = len(seeds), time.monotonic()
    while time.monotonic() - start < seconds:
        data = bytearray(rng.choice(seeds) if rng.random() < 0.9 else rng.randbytes(rng.randrange(64)))
        for _ in range(rng.randint(1, 8)):
            op = rng.randrange(4)
            if op == 0 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op == 1:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
            elif op == 2 and data:
                del data[rng.randrange(len(data))]
            else:
                other = rng.choice(seeds)
                if other:
                    i = rng.randrange(len(other))
                    data[rng.randrange(len(data) + 1) :] = other[i : i + rng.randrange(1, 64)]
        test_one_input(bytes(data))
        count += 1
    elapsed = time.monotonic() - start
    module = getattr(_codec._NATIVE_MODULE, "__file__", "?")
    print(f"mutate loop ({module}): {count} inputs in {elapsed:.0f} s ({count / elapsed:.0f}/s), no failure", flush=True)


def main() -> None:
    for arg in sys.argv[1:]:
        if arg.startswith("--mutate-loop="):  # --mutate-loop=SECONDS CORPUS_DIR [--seed=N]
            seconds = float(arg.split("=", 1)[1])
            seed = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--seed=")), 0)
            corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
            mutate_loop(corpus, seconds, seed)
            return
    run(test_one_input, write_seeds)


if __name__ == "__main__":
    main()
