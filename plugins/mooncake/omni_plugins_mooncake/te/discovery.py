"""Same-host discovery: each producer announces its control address as a file in a shared directory.

Lets identically configured instances (in several processes of one host) read
from each other without listing peers. A file holds the address and, when the
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
import uuid
from pathlib import Path
from typing import NamedTuple

from omni_plugins.errors import ConnectorError

logger = logging.getLogger(__name__)

_SUFFIX = ".peer"
_MAX_FILE = 4096


class PeerEntry(NamedTuple):
    """One announcement: its file, and the producer's secret when the file carries one."""

    path: Path
    secret: str | None


class PeerDirectory:
    """A directory of ``<id>.peer`` files, each holding ``host:port`` and optionally a secret on the next line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.path)
        if not stat.S_ISDIR(st.st_mode):
            raise ConnectorError(f"mooncake-te rendezvous_dir {self.path} is not a directory")
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ConnectorError(
                f"mooncake-te rendezvous_dir {self.path} must be private to this user (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}; need owner uid {os.getuid()} and no group/other write, e.g. 0700): "
                f"its files carry control-channel secrets and say which producers to trust"
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
