"""One hand-off mode per namespace, checked when an instance starts.

An instance with the slot table hands small payloads off in the table; one without it
(``slot_count: 0``, ``futex_wait: false``, or no C extension) never looks there, so a small
payload put by the first kind is invisible to the second (its ``get`` would time out). Each
instance therefore writes its mode into its liveness marker and then looks at the markers of
the namespace's other live instances: a different mode is a :class:`ConfigError` at
construction instead of lost payloads later. Both instances write before they look, so of two
instances starting at once at least the later looker sees the other's mode (a marker still
empty belongs to an instance that has not decided yet and is skipped; it looks itself).
"""

from __future__ import annotations

import os

from omni_plugins_shm.naming import MARKER, Names
from omni_plugins_shm.proc import Owner

#: a marker's content: the instance hands small payloads off in the slot table / only as files
TABLE = b"T"
FILES = b"F"


def declare(marker_path: str, mode: bytes) -> None:
    """Write ``mode`` into this instance's marker (created empty by :func:`pubdir.create_marker`)."""
    fd = os.open(marker_path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, mode, 0)
    finally:
        os.close(fd)


def others(publish_dir: str, names: Names, own_marker: str, mode: bytes) -> list[int]:
    """Pids of live instances of the namespace whose marker declares a mode other than ``mode``."""
    prefix = f"{names.prefix}{MARKER}."
    own = os.path.basename(own_marker)
    pids = []
    try:
        with os.scandir(publish_dir) as it:
            markers = [e.name for e in it if e.name.startswith(prefix) and e.name != own]
    except FileNotFoundError:
        return []
    for name in markers:
        owner = Owner.parse(name[len(prefix) :])
        if owner is None:
            continue
        try:
            fd = os.open(f"{publish_dir}/{name}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # closed meanwhile
        try:
            theirs = os.pread(fd, 1, 0)
        finally:
            os.close(fd)
        if theirs in (TABLE, FILES) and theirs != mode and owner.process_alive():
            pids.append(owner.pid)
    return pids
