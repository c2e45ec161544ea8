"""Claiming a payload's manifest, waiting for it without client-side polling when allowed.

A reader *claims* a payload by moving its manifest element atomically from
the manifest list to a claim list private to the connector instance and key
(deleted with the parts once they are read) (``LMOVE``; with a
timeout ``BLMOVE``, which blocks inside the server until a writer's ``RPUSH``
arrives: no polling loop). Exactly one reader wins. Because the element is
moved rather than popped, a reply lost when a server restarts mid-command is
recovered on the retry by looking into the claim list.

When the ACL user may not run ``BLMOVE`` the claimer falls back to polling
``LMOVE`` with exponential backoff, and says so once in the log.

With ``min_replica_acks`` a ``WAIT`` follows the move in the same write: a
get delivers only what the replicas confirmed (the move comes after the
payload's commit in the replication stream), and its claim list is on the
replicas before the parts are read, so a get interrupted by a failover finds
its claim on the promoted replica. A claim the replicas did not confirm is
settled by the connector (given back, discarded or delivered, see
``RedisConnector._settle_unconfirmed``); a blocking get then keeps waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis.exceptions import RedisError, ResponseError

from omni_plugins_redis.client import AuthError, Link, RedisClient
from omni_plugins_redis.config import RedisConfig
from omni_plugins_redis.keys import PayloadKeys
from omni_plugins_redis.packing import pack_many
from omni_plugins_redis.replies import Reply

log = logging.getLogger(__name__)

# A claim list outlives a crashed reader by at most this long.
CLAIM_TTL_MS = 600_000
_EXPIRE_CLAIM = b"*3\r\n$7\r\nPEXPIRE\r\n$%d\r\n%b\r\n" + b"$%d\r\n%d\r\n" % (len(str(CLAIM_TTL_MS)), CLAIM_TTL_MS)
_MOVE = b"*5\r\n$5\r\nLMOVE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$4\r\nLEFT\r\n$5\r\nRIGHT\r\n" + _EXPIRE_CLAIM
_BLOCKING_MOVE = b"*6\r\n$6\r\nBLMOVE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$4\r\nLEFT\r\n$5\r\nRIGHT\r\n$%d\r\n%b\r\n" + _EXPIRE_CLAIM


def move_commands(manifest_key: bytes, claim_key: bytes) -> bytes:
    """``LMOVE manifest claim LEFT RIGHT`` + ``PEXPIRE claim CLAIM_TTL_MS``, framed in one step (hot path of every get)."""
    return _MOVE % (len(manifest_key), manifest_key, len(claim_key), claim_key, len(claim_key), claim_key)


def blocking_move_commands(manifest_key: bytes, claim_key: bytes, timeout: float) -> bytes:
    """``BLMOVE manifest claim LEFT RIGHT timeout`` + ``PEXPIRE claim CLAIM_TTL_MS``, framed in one step."""
    seconds = b"%.3f" % timeout
    return _BLOCKING_MOVE % (len(manifest_key), manifest_key, len(claim_key), claim_key, len(seconds), seconds, len(claim_key), claim_key)


_MIN_BLOCK = 0.001


class Claimer:
    """Moves manifests into claim lists; shared by all ``get`` calls of one connector."""

    def __init__(self, client: RedisClient, config: RedisConfig, unconfirmed: Unconfirmed) -> None:
        """``unconfirmed(link, keys, claim_key, element)`` settles a claim the replicas did not confirm: True to deliver it."""
        self._client = client
        self._unconfirmed = unconfirmed
        self._config = config
        self._blocking = True
        self._warn_lock = threading.Lock()
        self._acks = config.min_replica_acks
        self._wait: tuple[str, int, int] | None = None
        self._wait_frame = b""
        if self._acks:
            self._wait = ("WAIT", self._acks, round(config.replica_ack_timeout * 1000))
            self._wait_frame = b"".join(pack_many([self._wait]))

    @property
    def blocking(self) -> bool:
        """False once the server refused ``BLMOVE`` (then ``get(timeout=)`` polls)."""
        return self._blocking

    def claim(
        self, keys: PayloadKeys, claim_key: bytes, timeout: float | None, on_claimed: OnClaimed | None = None
    ) -> bytes | bytearray | None:
        """Return the claimed manifest element, or None if none arrived in time.

        ``on_claimed(link, element)`` runs on the same connection right after a
        successful claim (e.g. to queue the claim list's deletion with no extra
        round trip).
        """
        deadline = None if not timeout or timeout <= 0 else time.monotonic() + timeout
        state = _ClaimState(on_claimed)
        if deadline is None:  # one attempt (retried only after connection failures)
            return self._client.run(keys.slot, lambda link: self._move_once(link, keys, claim_key, state), what="get", key=keys.key)
        if not self._blocking:
            return self._poll(keys, claim_key, deadline, state)
        try:
            while True:
                found = self._client.run(
                    keys.slot,
                    lambda link: self._blocking_step(link, keys, claim_key, deadline, state),
                    what="get",
                    key=keys.key,
                    deadline=deadline,
                )
                if not isinstance(found, _GivenBack):
                    return found
                if time.monotonic() >= deadline:
                    return None
        except AuthError as exc:
            if "blmove" not in str(exc).lower():
                raise
            self._fall_back(exc)
            return self._poll(keys, claim_key, deadline, state)

    def _fall_back(self, exc: Exception) -> None:
        with self._warn_lock:
            if self._blocking:
                self._blocking = False
                log.warning(
                    "Redis %s refuses BLMOVE (%s); get(timeout=) now polls with backoff. "
                    "Grant '+blmove' to the ACL user to wait inside the server instead.",
                    self._client.label,
                    exc,
                )

    def _recover(self, link: Link, claim_key: bytes, state: _ClaimState) -> bytes | bytearray | None:
        """After a failed attempt: did the lost reply carry our manifest?"""
        if not state.sent:
            return None
        return peek_claim(link, claim_key)

    def _blocking_step(self, link: Link, keys: PayloadKeys, claim_key: bytes, deadline: float, state: _ClaimState) -> Claimed:
        found = self._recover(link, claim_key, state)
        if found is not None:
            return _claimed(link, found, state)
        remaining = deadline - time.monotonic()
        if remaining < _MIN_BLOCK:
            return self._move_once(link, keys, claim_key, state)
        state.sent = True
        link.send_frame(blocking_move_commands(keys.manifest, claim_key, remaining) + self._wait_frame)
        moved, expire = link.read_pair(timeout=remaining + self._config.socket_timeout)
        confirmed = self._confirmed(link, keys, claim_key, moved)
        state.sent = False
        return _taken(link, moved, expire, state) if confirmed else _GIVEN_BACK

    def _move_once(self, link: Link, keys: PayloadKeys, claim_key: bytes, state: _ClaimState) -> bytes | bytearray | None:
        if state.sent:
            found = peek_claim(link, claim_key)
            if found is not None:
                return _claimed(link, found, state)
        state.sent = True
        link.send_frame(move_commands(keys.manifest, claim_key) + self._wait_frame)
        moved, expire = link.read_pair()
        confirmed = self._confirmed(link, keys, claim_key, moved)
        state.sent = False
        return _taken(link, moved, expire, state) if confirmed else None

    def _confirmed(self, link: Link, keys: PayloadKeys, claim_key: bytes, moved: Reply) -> bool:
        """With ``min_replica_acks``: read the claim's ``WAIT``; a shortfall is settled before anything is delivered."""
        if self._wait is None:
            return True
        acked = link.read()
        if isinstance(acked, RedisError):
            raise acked
        if not isinstance(moved, bytes | bytearray) or not isinstance(acked, int) or acked >= self._acks:
            return True
        log.debug("get %r on Redis %s: %d of %d replicas confirmed the claim", keys.key, link.route.name, acked, self._acks)
        return self._unconfirmed(link, keys, claim_key, moved)

    def _poll(self, keys: PayloadKeys, claim_key: bytes, deadline: float, state: _ClaimState) -> bytes | bytearray | None:
        delay = 0.001
        while True:
            found = self._client.run(
                keys.slot, lambda link: self._move_once(link, keys, claim_key, state), what="get", key=keys.key, deadline=deadline
            )
            if found is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, self._config.poll_interval_max)


OnClaimed = Callable[[Link, bytes | bytearray], None]
Unconfirmed = Callable[[Link, PayloadKeys, bytes, bytes | bytearray], bool]


class _GivenBack:
    """A blocking claim's payload went back to its list (replicas did not confirm it): keep waiting."""


_GIVEN_BACK = _GivenBack()
Claimed = bytes | bytearray | None | _GivenBack


class _ClaimState:
    """One claim across retries: whether a move may have run on the server, what to do once claimed."""

    __slots__ = ("on_claimed", "sent")

    def __init__(self, on_claimed: OnClaimed | None) -> None:
        self.sent = False
        self.on_claimed = on_claimed


def peek_claim(link: Link, claim_key: bytes) -> bytes | bytearray | None:
    """The element held in a claim list, if any (left there by a get whose reply was lost)."""
    link.send([("LINDEX", claim_key, 0)])
    element = link.read()
    if isinstance(element, RedisError):
        raise element
    return element if isinstance(element, bytes | bytearray) else None


def _taken(link: Link, moved: Reply, expire: Reply, state: _ClaimState) -> bytes | bytearray | None:
    """The claimed element (or None).

    The claim list keeps the element until the connector has read every part and
    deletes it together with the parts: a reply lost now, or a server outage
    while the parts are read, leaves the payload in the claim list, where the
    connector's next get of the same key finds it.
    """
    if isinstance(moved, RedisError):
        raise moved
    if isinstance(expire, RedisError):
        raise expire
    if moved is None:
        return None
    if not isinstance(moved, bytes | bytearray):
        raise ResponseError(f"unexpected reply to LMOVE: {type(moved).__name__}")
    return _claimed(link, moved, state)


def _claimed(link: Link, element: bytes | bytearray, state: _ClaimState) -> bytes | bytearray:
    if state.on_claimed is not None:
        state.on_claimed(link, element)
    return element
