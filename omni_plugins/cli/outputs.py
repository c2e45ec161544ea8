"""Output files of long commands (``run --report``, ``bench --json/--plot``), checked before the work starts.

A run can take minutes; finding out afterwards that its report cannot be
written would lose the results.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from omni_plugins.errors import ConfigError


def check_writable(path: str | None, option: str) -> None:
    """Raise :class:`ConfigError` now if ``path`` cannot be written (missing directory, a directory, no permission).

    The check opens the file for appending (an existing file is left unchanged)
    and removes it again if it did not exist.
    """
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {path}: is a directory")
    existed = p.exists()
    try:
        with open(p, "ab"):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None
    if not existed:
        with contextlib.suppress(OSError):
            p.unlink()


def write_failed(path: str, option: str, exc: OSError) -> ConfigError:
    """The error for a write that failed anyway (disk full, directory removed meanwhile)."""
    return ConfigError(f"{option} {path}: cannot write: {exc.strerror or exc}")
