"""Process identity and liveness: a pid plus its start time names a process uniquely.

Pids are reused; the start time (field 22 of ``/proc/<pid>/stat``, clock ticks
since boot) is not, so ``(pid, start)`` tells a crashed producer's segments
from those of a live process that happens to have the same pid.
"""

from __future__ import annotations

import os
import secrets
from typing import NamedTuple

from omni_plugins_shm.shortage import is_shortage


class CurrentPid:
    """This process's pid, refreshed in a forked child (``os.getpid()`` is a system call: ~0.4 us, on every op)."""

    value = os.getpid()

    @classmethod
    def refresh(cls) -> None:
        cls.value = os.getpid()


os.register_at_fork(after_in_child=CurrentPid.refresh)


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def running_start_time(pid: int) -> int | None:
    """Start time of ``pid`` if it runs (None if there is no such process or it is a zombie).

    ``OSError`` when this process cannot tell for want of a descriptor or memory (``EMFILE``,
    ``ENOMEM``...): a live process must never be judged dead -- and its segments freed -- for that.
    """
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        if is_shortage(exc):
            raise
        return None
    tail = raw[raw.rfind(b")") + 2 :].split()
    try:
        return None if tail[0] == b"Z" else int(tail[19])
    except (IndexError, ValueError):
        return None


def is_process_alive(pid: int, start: int) -> bool:
    """True if the process ``pid`` that started at ``start`` still runs (zombies count as dead)."""
    return running_start_time(pid) == start


class Owner(NamedTuple):
    """Identity of one connector instance: process (pid, start time) plus a random instance tag.

    Its token ``<pid>-<start>-<tag>`` appears in the names of the segments it owns.
    """

    pid: int
    start: int
    tag: int

    @property
    def token(self) -> str:
        return f"{self.pid}-{self.start}-{self.tag:08x}"

    @classmethod
    def new(cls) -> Owner:
        pid = os.getpid()
        start = process_start_time(pid)
        if start is None:  # pragma: no cover - /proc is always there on Linux
            raise RuntimeError("cannot read /proc/self/stat; the shm connector needs Linux /proc")
        return cls(pid, start, secrets.randbits(32))

    @classmethod
    def parse(cls, token: str) -> Owner | None:
        parts = token.split("-")
        if len(parts) != 3:
            return None
        try:
            return cls(int(parts[0]), int(parts[1]), int(parts[2], 16))
        except ValueError:
            return None

    def process_alive(self) -> bool:
        return is_process_alive(self.pid, self.start)
