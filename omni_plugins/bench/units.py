"""Sizes as people write them (``4KiB``, ``64MiB``) and back."""

from __future__ import annotations

_UNITS = {
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
}

KIB = 1 << 10
MIB = 1 << 20


def parse_size(text: str) -> int:
    """``"64KiB"`` -> 65536 (``k``/``m``/``g`` are binary too; ``kb``/``mb``/``gb`` decimal)."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :] or "b"
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r} (examples: 4KiB, 1MiB, 64MiB)")
    return int(float(num) * _UNITS[unit])


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, each positive."""
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"expected positive sizes, e.g. 4KiB,1MiB; got {text!r}")
    return sizes


def format_size(n: int) -> str:
    """65536 -> ``"64KiB"`` (exact binary units only, else bytes)."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f and n % f == 0:
            return f"{n // f}{unit}"
    return f"{n}B"
