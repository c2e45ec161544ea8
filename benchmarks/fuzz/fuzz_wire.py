"""Coverage-guided fuzzing of ``omni_plugins.wire.decode`` with atheris (libFuzzer).

Contract under test: on any input the decoder returns or raises
:class:`~omni_plugins.errors.WireFormatError` from a named check -- never another
exception, never the decoder's catch-all ("malformed message"), never a hang
(libFuzzer's ``-timeout``), never a large allocation (the process runs under
``RLIMIT_AS`` = current address space + ``--as-headroom-mib``, and a
``MemoryError`` turned into a WireFormatError is reported as a crash too).

Inputs reach past the checksum: the first byte picks a mode --

* ``raw``: the bytes as they are (prefix checks);
* ``sealed``: the rest is ``header || data``; a valid prefix with the right
  ``header_len``, CRC and ``total_len`` is put in front (header parser, table checks);
* ``mutated``: a valid sample message with fuzzer-chosen byte edits, resealed.

Run::

    python benchmarks/fuzz/fuzz_wire.py -runs=1000000 -timeout=10 -rss_limit_mb=4096 [corpus_dir]
    python benchmarks/fuzz/fuzz_wire.py -max_total_time=5       # a bounded smoke run

Crashes are written by libFuzzer as ``crash-<sha1>`` files; replay one with
``python benchmarks/fuzz/fuzz_wire.py crash-<sha1>``.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any

import atheris
from _harness import run

with atheris.instrument_imports(include=["omni_plugins.wire", "msgpack"]):
    from omni_plugins import wire
    from omni_plugins.errors import WireFormatError

import numpy as np
import torch

PREFIX = struct.Struct("<4sBBHIIQ")


def _samples() -> list[bytes]:
    payloads: list[Any] = [
        {"t": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": np.arange(5, dtype=np.int64), "s": "x", "l": [1, 2.5, None]},
        {"meta": {"finished": True}, "embed": {"decode": torch.ones(2, 3, dtype=torch.bfloat16)}, "b": b"z" * 300},
        [(1, (2, 3)), {"k": torch.tensor([True, False])}, torch.zeros(0, 4)],
        torch.arange(7, dtype=torch.int8),
    ]
    return [wire.encode(p).to_bytes() for p in payloads]


SAMPLES = _samples()


def seal(header: bytes, data: bytes) -> bytes:
    """A message with a valid prefix around an arbitrary header and data section."""
    start = wire._format.align(wire.PREFIX_SIZE + len(header))
    body = header + bytes(start - wire.PREFIX_SIZE - len(header)) + data
    total = wire.PREFIX_SIZE + len(body)
    return PREFIX.pack(wire.MAGIC, wire.FORMAT_VERSION, 0, 0, len(header), zlib.crc32(header), total) + body


def reseal(buf: bytearray) -> bytes:
    if len(buf) >= wire.PREFIX_SIZE:
        hlen = struct.unpack_from("<I", buf, 8)[0]
        struct.pack_into("<I", buf, 12, zlib.crc32(buf[wire.PREFIX_SIZE : wire.PREFIX_SIZE + hlen]))
    return bytes(buf)


def make_input(data: bytes) -> bytes:
    if not data:
        return b""
    mode, rest = data[0] % 3, data[1:]
    if mode == 0:
        return rest
    fdp = atheris.FuzzedDataProvider(rest)
    if mode == 1:
        hlen = fdp.ConsumeIntInRange(0, 4096)
        header = fdp.ConsumeBytes(hlen)
        return seal(header, fdp.ConsumeBytes(fdp.remaining_bytes()))
    sample = bytearray(SAMPLES[fdp.ConsumeIntInRange(0, len(SAMPLES) - 1)])
    for _ in range(fdp.ConsumeIntInRange(1, 8)):
        if fdp.remaining_bytes() < 2:
            break
        pos = fdp.ConsumeIntInRange(0, len(sample) - 1)
        sample[pos] = fdp.ConsumeInt(1) & 0xFF
    if fdp.ConsumeBool():
        del sample[fdp.ConsumeIntInRange(0, len(sample)) :]
    return reseal(sample)


def test_one_input(data: bytes) -> None:
    message = make_input(data)
    for copy in (False, True):
        try:
            wire.decode(message, copy=copy)
        except WireFormatError as exc:
            text = str(exc)
            if "malformed message" in text or "MemoryError" in text:
                raise AssertionError(f"decoder left a named-check path: {text}") from exc


def write_seeds(directory: str) -> None:
    """Seed an empty corpus directory with the valid sample messages (raw mode)."""
    os.makedirs(directory, exist_ok=True)
    if not os.listdir(directory):
        for i, sample in enumerate(SAMPLES):
            with open(os.path.join(directory, f"seed-{i}"), "wb") as f:
                f.write(b"\x00" + sample)


def main() -> None:
    run(test_one_input, write_seeds)


if __name__ == "__main__":
    main()
