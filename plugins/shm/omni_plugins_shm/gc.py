"""Reclaiming segments whose owner is gone: ``collect(namespace=None) -> GcReport``.

Liveness is decided from the names and headers alone, so any process (the next
connector instance, ``omni-plugins shm gc``, a test) can run it safely next to
live producers and consumers:

Markers and published payloads live in the namespace's publish directory (see
:mod:`omni_plugins_shm.pubdir`), the rest in the shm directory; both are scanned.

- ``o.<owner>`` marker: removed when the owner process is dead.
- ``w.``/``f.`` (a producer's writing/free segments): removed when the owner process is dead or its
  marker is gone (the instance closed).
- ``c.<claimer>`` (a claimed payload, possibly with live zero-copy views): removed when the claiming
  process is dead.
- ``k.``/``h.`` (published payloads): removed when the producer named in the header is dead or closed,
  or when the header is corrupt.

A name whose owner or header cannot be read for want of a descriptor or memory (``EMFILE``,
``ENOMEM``) is kept and listed in the report's errors: running short is not death or corruption.
- ``x.wake`` (the namespace's wake file): removed when no live instance holds its ``flock``
  (checked and removed under an exclusive lock, see :mod:`omni_plugins_shm.wakeslots`).

A process is identified by pid *and* start time, so a reused pid does not keep
a dead producer's memory alive. ``force=True`` removes everything in the
namespace(s) regardless (for operators, when nothing runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from omni_plugins_shm import pubdir, slots, wakeslots
from omni_plugins_shm.naming import (
    CLAIMED,
    FREE,
    HASHED,
    MARKER,
    PREFIX,
    PUBLISH_DIR,
    PUBLISHED,
    WAKE,
    WRITING,
    Names,
    namespace_prefix,
    parse_name,
)
from omni_plugins_shm.proc import Owner
from omni_plugins_shm.segments.header import HEADER_SIZE, Header, HeaderError
from omni_plugins_shm.shortage import is_shortage

DEFAULT_SHM_DIR = "/dev/shm"


@dataclass
class GcReport:
    """What :func:`collect` removed (names and bytes) and what it kept because its owner lives."""

    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"removed": self.removed, "kept": self.kept, "bytes_freed": self.bytes_freed, "errors": self.errors}


def read_header(path: str) -> Header | None:
    """The header of the segment at ``path``, or None if it is gone or not a valid segment.

    ``OSError`` when this process cannot read it for want of a descriptor or memory (``EMFILE``...):
    a segment is never judged invalid -- and removed -- for that.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        if is_shortage(exc):
            raise
        return None
    try:
        size = os.fstat(fd).st_size
        return Header.unpack(os.pread(fd, HEADER_SIZE, 0), size)
    except OSError as exc:
        if is_shortage(exc):
            raise
        return None
    except HeaderError:
        return None
    finally:
        os.close(fd)


class _Liveness:
    """Memoized owner checks for one collection pass."""

    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._process: dict[tuple[int, int], bool] = {}

    def process(self, owner: Owner) -> bool:
        k = (owner.pid, owner.start)
        if k not in self._process:
            self._process[k] = owner.process_alive()
        return self._process[k]

    def instance(self, namespace: str, owner: Owner) -> bool:
        names = Names(namespace)
        return self.process(owner) and os.path.exists(os.path.join(self._dir, names.publish_dir, names.marker(owner.token)))


def _garbage(directory: str, name: str, live: _Liveness) -> bool:
    parsed = parse_name(name)
    if parsed is None:
        return False
    if parsed.kind in (PUBLISHED, HASHED):
        header = read_header(os.path.join(directory, name))
        return header is None or not live.instance(parsed.namespace, header.owner)
    owner = Owner.parse(parsed.owner_token or "")
    if owner is None:
        return True  # malformed name inside our prefix
    if parsed.kind == MARKER or parsed.kind == CLAIMED:
        return not live.process(owner)
    if parsed.kind in (WRITING, FREE):
        return not live.instance(parsed.namespace, owner)
    return False


def _counted_in(directory: str, name: str) -> str | None:
    """The slot table whose file-path hint counts the published payload ``name`` (None if it is not counted)."""
    parsed = parse_name(name)
    if parsed is None or parsed.kind not in (PUBLISHED, HASHED):
        return None
    header = read_header(os.path.join(directory, name))
    return os.path.join(directory, Names(parsed.namespace).slots()) if header is not None and header.counted else None


def _is_wake(name: str) -> bool:
    parsed = parse_name(name)
    return parsed is not None and parsed.kind == WAKE


def _is_slot_table(name: str) -> bool:
    """The slot table or a creator's temporary of it (held under a shared lock while it is written)."""
    parsed = parse_name(name)
    return parsed is not None and parsed.kind == WAKE and name.split(".", 3)[3].startswith("slots")


def _is_publish_dir(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == PREFIX and parts[2] == PUBLISH_DIR and bool(parts[1])


def _entries(shm_dir: str, prefix: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``(directory, name)`` of every file of the namespace(s), markers last; and the publish directories."""
    with os.scandir(shm_dir) as it:
        top = [e.name for e in it if e.name.startswith(prefix)]
    dirs = [n for n in top if _is_publish_dir(n)]
    entries = [(shm_dir, n) for n in top if not _is_publish_dir(n)]
    for d in dirs:
        path = os.path.join(shm_dir, d)
        try:
            with os.scandir(path) as it:
                entries += [(path, e.name) for e in it if e.name.startswith(prefix)]
        except (FileNotFoundError, NotADirectoryError):
            continue
    entries.sort(key=lambda entry: entry[1].split(".", 3)[2:3] == [MARKER])
    return entries, dirs


def live_instances(namespace: str | None = None, *, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Liveness markers (``o.<owner>`` names) of connector instances whose process still runs, in ``namespace``
    (all namespaces if None): what ``gc --all`` would pull the memory from under."""
    prefix = namespace_prefix(namespace) if namespace is not None else f"{PREFIX}."
    try:
        entries, _ = _entries(shm_dir, prefix)
    except FileNotFoundError:
        return []
    live = _Liveness(shm_dir)
    found = []
    for _, name in entries:
        parsed = parse_name(name)
        if parsed is None or parsed.kind != MARKER:
            continue
        owner = Owner.parse(parsed.owner_token or "")
        if owner is not None and live.process(owner):
            found.append(name)
    return found


def collect(namespace: str | None = None, *, shm_dir: str = DEFAULT_SHM_DIR, force: bool = False, dry_run: bool = False) -> GcReport:
    """Remove segments of dead (or closed) owners in ``namespace`` (all namespaces if None).

    Markers are handled last, so the segments of an instance are judged while its marker still says
    whether it is alive. A wake file no live instance holds and a publish directory left empty are
    removed too (not listed in the report).
    Safe to run concurrently with live connectors.
    """
    prefix = namespace_prefix(namespace) if namespace is not None else f"{PREFIX}."
    report = GcReport()
    try:
        entries, dirs = _entries(shm_dir, prefix)
    except FileNotFoundError:
        return report
    live = _Liveness(shm_dir)
    counted: dict[str, int] = {}  # slot table path -> counted file payloads removed (its file-path hint goes down)
    for directory, name in entries:
        path = os.path.join(directory, name)
        try:
            if not force and _is_slot_table(name):
                # removed like the wake file when no live instance holds it; else its slots of dead
                # processes are freed (WRITING / CLAIMED: the owner died mid-put / mid-get; READY: a dead producer)
                # and the pages of larger slots idle longer than the table's slot_idle_seconds are given back
                done = slots.reclaim(path, dry_run)
                report.removed += [f"{name}[slot]"] * done.slots
                report.bytes_freed += done.trimmed
                continue
            if not force and _is_wake(name):
                # namespace infrastructure like the publish directory (not listed in the report); removed
                # only under its exclusive lock: no live instance holds it (dead ones hold nothing)
                wakeslots.remove_if_unused(path, dry_run)
                continue
            if not (force or _garbage(directory, name, live)):
                report.kept.append(name)
                continue
            size = os.stat(path).st_blocks * 512
            if not dry_run:
                table = _counted_in(directory, name)
                os.unlink(path)
                if table is not None:
                    counted[table] = counted.get(table, 0) + 1
            report.removed.append(name)
            report.bytes_freed += size
        except FileNotFoundError:
            continue  # consumed or freed meanwhile
        except OSError as exc:
            report.errors.append(f"{name}: {exc}")
    for table, n in counted.items():
        slots.lower_files_hint(table, n)
    if not dry_run:
        for d in dirs:
            try:
                pubdir.remove_if_empty(os.path.join(shm_dir, d))
            except OSError as exc:
                report.errors.append(f"{d}: {exc}")
    return report
