"""The wire decoder under an address-space limit: lying headers and mutated messages allocate nothing
large -- checked where it matters, in a process whose ``RLIMIT_AS`` sits 256 MiB above what it already
maps, so an attempt to allocate a declared-but-absent buffer would fail there instead of succeeding
quietly. ``tests/wire/test_fuzz.py`` (the wire owner's) covers the hypothesis round-trip and corruption
properties and a tracemalloc check; this adds the hard limit and bounded runs of the atheris harnesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_plugins import wire

ROOT = Path(__file__).resolve().parents[2]

UNDER_RLIMIT = textwrap.dedent(
    """
    import os, random, resource, struct, zlib
    import msgpack, numpy, torch
    from omni_plugins import wire
    from omni_plugins.errors import WireFormatError

    def seal(tree, table, data=b"", total=None):
        header = msgpack.packb([tree, table], use_bin_type=True)
        start = wire._format.align(wire.PREFIX_SIZE + len(header))
        body = header + bytes(start - wire.PREFIX_SIZE - len(header)) + data
        size = wire.PREFIX_SIZE + len(body)
        prefix = struct.pack("<4sBBHIIQ", wire.MAGIC, 1, 0, 0, len(header), zlib.crc32(header), size if total is None else total)
        return prefix + body

    REF = msgpack.ExtType(1, b"")
    F32, U8 = 9, 64
    lies = [
        seal(REF, [[F32, 0, 4 * 2**34, [2**34]]], bytes(64)),
        seal([REF] * 4000, [[F32, 0, 2**30, [2**28]]] * 4000, bytes(64)),
        seal(REF, [[U8, 0, 2**40, [2**40]]], bytes(64)),
        seal(REF, [[F32, 0, 0, [2**62, 0]]], b""),
        seal(REF, [[F32, 0, 2**63 - 4, [2**61 - 1]]], bytes(64)),
        seal([], [], total=2**63),
        struct.pack("<4sBBHIIQ", wire.MAGIC, 1, 0, 0, 2**32 - 1, 0, 2**64 - 1),
        seal("x" * 100, []) [:40],
    ]
    sample = wire.encode({"t": torch.arange(64.0).reshape(8, 8), "b": b"q" * 5000, "l": [1, (2, "3")], "n": numpy.ones(3)}).to_bytes()

    with open(f"/proc/{os.getpid()}/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + (256 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        bytearray(512 << 20)
        raise SystemExit("the address-space limit is not in force")
    except MemoryError:
        pass

    rng = random.Random(1234)
    inputs = list(lies)
    for _ in range(3000):
        buf = bytearray(sample)
        for _ in range(rng.randint(1, 6)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        if rng.random() < 0.7:  # reseal so the mutation reaches the header parser
            hlen = struct.unpack_from("<I", buf, 8)[0]
            struct.pack_into("<I", buf, 12, zlib.crc32(buf[24 : 24 + hlen]))
        inputs.append(bytes(buf))
    bad = 0
    for message in inputs:
        for copy in (False, True):
            try:
                wire.decode(message, copy=copy)
            except WireFormatError as exc:
                text = str(exc)
                assert "MemoryError" not in text and "malformed message" not in text, text
                bad += 1
    print("OK", len(inputs), bad)
    """
)


@pytest.mark.parametrize("pure", ["0", "1"], ids=["default", "pure-python"])
def test_decoder_under_address_space_limit(pure: str) -> None:
    """Once with the implementation the install provides (the compiled one when built), once pure Python."""
    env = {**os.environ, "OMNI_WIRE_PURE": pure}
    proc = subprocess.run([sys.executable, "-c", UNDER_RLIMIT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    status, count, rejected = proc.stdout.split()[-3:]
    assert status == "OK" and int(count) > 3000 and int(rejected) >= 8 * 2


@pytest.mark.parametrize(("harness", "runs"), [("fuzz_wire.py", 3000), ("fuzz_wire_native.py", 3000), ("fuzz_config.py", 300)])
def test_bounded_atheris_run(harness: str, runs: int, tmp_path: Path) -> None:
    """A few thousand coverage-guided inputs through each long-run harness (skipped without atheris).

    ``fuzz_wire_native.py`` compares the compiled header path with the pure-Python one on every input.
    """
    pytest.importorskip("atheris")
    if harness == "fuzz_wire_native.py" and wire.IMPLEMENTATION != "native":
        pytest.skip("omni_plugins.wire._native is not built")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fuzz" / harness), f"-runs={runs}", "-timeout=20", str(tmp_path / "corpus")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Done {runs} runs" in proc.stderr
