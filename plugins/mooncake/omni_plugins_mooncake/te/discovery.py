"""Same-host discovery: each producer announces its control address as a file in a shared directory.

Lets identically configured instances (in several processes of one host) read
from each other without listing peers. Files are mode 0600 and removed on
close; an entry whose address refuses connections (a crashed process) is
removed by the first reader that notices.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

_SUFFIX = ".peer"


class PeerDirectory:
    """A directory of ``<id>.peer`` files, each holding one ``host:port``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._own: Path | None = None

    def announce(self, address: str) -> None:
        """Publish ``address`` atomically (write a temp file, then rename)."""
        name = f"{os.getpid()}-{uuid.uuid4().hex}"
        tmp = self.path / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(address)
        final = self.path / f"{name}{_SUFFIX}"
        os.replace(tmp, final)
        self._own = final

    def peers(self) -> dict[str, Path]:
        """Announced addresses (this instance's own excluded) -> their files."""
        found: dict[str, Path] = {}
        try:
            entries = list(self.path.iterdir())
        except FileNotFoundError:
            return found
        for entry in entries:
            if entry.suffix != _SUFFIX or entry == self._own:
                continue
            try:
                address = entry.read_text(encoding="ascii").strip()
            except (OSError, UnicodeDecodeError):
                continue
            if address:
                found[address] = entry
        return found

    def forget(self, entry: Path) -> None:
        """Remove a stale announcement."""
        logger.info("removing stale mooncake-te peer announcement %s", entry)
        entry.unlink(missing_ok=True)

    def close(self) -> None:
        if self._own is not None:
            self._own.unlink(missing_ok=True)
            self._own = None
