"""Same-host discovery: each producer announces its control address as a file in a shared directory.

Lets identically configured instances (in several processes of one host) read
from each other without listing peers. By default (:func:`default_rendezvous_dir`)
the directory is private to the user and to the network namespace: an address
only means something in the namespace it was announced in. A file holds the address and, when the
producer generated its control-channel secret (none configured), that secret:
so the directory must be private to the user. It is created 0700; an existing
one owned by someone else or writable by group/others is refused, and files
not owned by this user are ignored. Files are mode 0600 and removed on close;
an entry whose address refuses connections (a crashed process) is removed by
the first reader that notices.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import uuid
from pathlib import Path
from typing import NamedTuple

from omni_plugins.errors import ConnectorError

logger = logging.getLogger(__name__)

_SUFFIX = ".peer"
_MAX_FILE = 4096


AUTO = "auto"


def default_rendezvous_dir() -> Path:
    """``$XDG_RUNTIME_DIR/omni-plugins`` (else ``$TMPDIR/omni-plugins-UID``) ``/mooncake-te/net-INODE``.

    One directory per user and network namespace (``INODE`` of ``/proc/self/ns/net``):
    processes in other namespaces -- containers, test sandboxes -- announce addresses
    that are unreachable (or someone else's) here, so they never share a directory.
    The per-user base is created 0700 and refused when another user owns it or
    group/others may write to it.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir() and _private_problem(Path(runtime)) is None:
        base = Path(runtime) / "omni-plugins"
    else:
        base = Path(tempfile.gettempdir()) / f"omni-plugins-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    problem = _private_problem(base)
    if problem is not None:
        raise ConnectorError(f"mooncake-te default rendezvous directory {base}: {problem}; set rendezvous_dir to a private directory")
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # no procfs (not Linux): one namespace is all there is
        netns = 0
    return base / "mooncake-te" / f"net-{netns}"


def resolve_rendezvous_dir(setting: str | None) -> Path | None:
    """The directory a ``rendezvous_dir`` setting names (``auto``: :func:`default_rendezvous_dir`), or None."""
    if not setting:
        return None
    return default_rendezvous_dir() if setting == AUTO else Path(setting)


def _private_problem(path: Path) -> str | None:
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return (
            f"must be private to this user (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}; need owner uid "
            f"{os.getuid()} and no group/other write, e.g. 0700)"
        )
    return None


class PeerEntry(NamedTuple):
    """One announcement: its file, and the producer's secret when the file carries one."""

    path: Path
    secret: str | None


class PeerDirectory:
    """A directory of ``<id>.peer`` files, each holding ``host:port`` and optionally a secret on the next line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _private_problem(self.path)
        if problem is not None:
            raise ConnectorError(
                f"mooncake-te rendezvous_dir {self.path} {problem}: its files carry control-channel secrets and say which producers to trust"
            )
        self._own: Path | None = None

    def announce(self, address: str, secret: str | None = None) -> None:
        """Publish ``address`` (and ``secret``) atomically: write a 0600 temp file, then rename."""
        name = f"{os.getpid()}-{uuid.uuid4().hex}"
        tmp = self.path / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(address if secret is None else f"{address}\n{secret}\n")
        final = self.path / f"{name}{_SUFFIX}"
        os.replace(tmp, final)
        self._own = final

    def peers(self) -> dict[str, PeerEntry]:
        """Announced addresses (this instance's own and files of other users excluded) -> their entries."""
        found: dict[str, PeerEntry] = {}
        try:
            entries = list(self.path.iterdir())
        except FileNotFoundError:
            return found
        uid = os.getuid()
        for entry in entries:
            if entry.suffix != _SUFFIX or entry == self._own:
                continue
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                    continue
                text = os.read(fd, _MAX_FILE).decode("ascii")
            except (OSError, UnicodeDecodeError):
                continue
            finally:
                os.close(fd)
            address, _, secret = text.strip().partition("\n")
            if address.strip():
                found[address.strip()] = PeerEntry(entry, secret.strip() or None)
        return found

    def forget(self, entry: PeerEntry) -> None:
        """Remove a stale announcement."""
        logger.info("removing stale mooncake-te peer announcement %s", entry.path)
        entry.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._own is not None:
            self._own.unlink(missing_ok=True)
            self._own = None
