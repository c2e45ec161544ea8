"""Cross-host discovery: a roster of producers' control addresses on Mooncake's HTTP metadata server.

A Mooncake deployment already runs an HTTP metadata server (``mooncake_master
--enable_http_metadata_server``, or ``mooncake_http_metadata_server``): it is
where Transfer Engines publish their segments, and vLLM-Omni's Mooncake
configs name it as ``metadata_server``. ``mooncake-te`` keeps one small JSON
document there per discovery group, under
``omni-plugins/mooncake-te/<group>/roster``::

    {"v": 1, "peers": {"10.0.0.7:7500": 1767225600.0, ...}}   # address -> expiry (unix seconds)

The server offers only GET / PUT / DELETE of whole values, so a producer
updates the roster by read-modify-write: it adds itself with an expiry
``ttl`` seconds ahead, drops expired entries, writes it back and reads it
again to check it is there (two producers writing at once can drop each
other's entry; each heartbeat puts it back). Every ``ttl / 3`` seconds it
does that again; on close it takes itself out. Consumers re-read the roster
every ``refresh`` seconds from a background thread and keep the last good
copy while the server is unreachable, so a get never waits on it.

Only addresses travel here, never secrets: the server is unauthenticated, so
an entry is a hint. A consumer proves (and checks) the configured shared
secret on every control connection; an address that refuses the connection
or the secret is skipped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from omni_plugins.errors import ConnectorError

logger = logging.getLogger(__name__)

_MAX_ROSTER = 1 << 20  # bytes: a roster larger than this is not ours
_KEY = "omni-plugins/mooncake-te/{group}/roster"


class MetadataRoster:
    """The roster of one discovery group on an HTTP metadata server (``http://host:port/metadata``)."""

    def __init__(self, url: str, group: str, *, ttl: float = 30.0, timeout: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.url = url.rstrip("/")
        self.key = _KEY.format(group=group)
        self.ttl = ttl
        self.timeout = timeout
        self._clock = clock
        self._cached: dict[str, float] = {}
        self._lock = threading.Lock()

    # -- the server ---------------------------------------------------------------
    def _request(self, method: str, body: bytes | None = None) -> bytes | None:
        """One request; None for a key that is not there (404)."""
        url = f"{self.url}?key={urllib.parse.quote(self.key, safe='')}"
        request = urllib.request.Request(url, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return bytes(reply.read(_MAX_ROSTER + 1))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise ConnectorError(f"mooncake-te discovery: metadata server {self.url} answered {method} with HTTP {exc.code}") from exc
        except (OSError, ValueError) as exc:
            raise ConnectorError(f"mooncake-te discovery: metadata server {self.url} unreachable ({method}): {exc}") from exc

    def read(self) -> dict[str, float]:
        """The roster on the server now (address -> expiry), expired entries left out; refreshes the cache."""
        raw = self._request("GET")
        peers = _parse(raw) if raw is not None and len(raw) <= _MAX_ROSTER else {}
        now = self._clock()
        live = {address: expiry for address, expiry in peers.items() if expiry > now}
        with self._lock:
            self._cached = live
        return live

    def _write(self, peers: dict[str, float]) -> None:
        if peers:
            self._request("PUT", json.dumps({"v": 1, "peers": peers}, sort_keys=True).encode())
        else:
            self._request("DELETE")

    # -- producer ---------------------------------------------------------------------
    def announce(self, address: str, attempts: int = 3) -> None:
        """Add (or renew) ``address``; re-read to check, and write again if a concurrent writer dropped it."""
        for _ in range(attempts):
            peers = self.read()
            peers[address] = self._clock() + self.ttl
            self._write(peers)
            if address in self.read():
                return
            time.sleep(0.05)
        logger.warning("mooncake-te discovery: %s did not stay in the roster at %s; the next heartbeat retries", address, self.url)

    def withdraw(self, address: str) -> None:
        peers = self.read()
        if peers.pop(address, None) is not None:
            self._write(peers)

    # -- consumer -----------------------------------------------------------------------
    def cached(self) -> dict[str, float]:
        """Entries (address -> expiry) of the last successful read that have not expired since (no network I/O)."""
        now = self._clock()
        with self._lock:
            return {address: expiry for address, expiry in self._cached.items() if expiry > now}


def _parse(raw: bytes) -> dict[str, float]:
    """Untrusted JSON from an unauthenticated server: keep only well-formed ``address -> number`` entries."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    peers = doc.get("peers") if isinstance(doc, dict) else None
    if not isinstance(peers, dict):
        return {}
    return {
        str(address): float(expiry)
        for address, expiry in peers.items()
        if isinstance(address, str) and len(address) < 300 and isinstance(expiry, (int, float)) and not isinstance(expiry, bool)
    }
