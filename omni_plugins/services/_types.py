"""The values services exchange with the core: a run's scope, what a census or reclaim found, a server, a baseline end."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from omni_plugins.errors import OmniPluginsError

if TYPE_CHECKING:
    import torch


class ServiceUnavailable(OmniPluginsError):
    """A service cannot run here or for this config (a binary is missing, a topology it cannot inspect); the message says why."""


@dataclass(frozen=True)
class RunScope:
    """One run of ``omni-plugins run``: every request id of the run starts with :attr:`request_prefix`.

    The runtime's keys (and the KV manager's) start with the request id, so a backend key
    of this run's payloads starts with the prefix too: a census or reclaim matches it and
    touches nothing of other runs sharing the backend.
    """

    tag: str

    def __post_init__(self) -> None:
        if not self.tag.isalnum():  # a key pattern built from it must not widen (no glob or regex characters)
            raise ValueError(f"run tag must be alphanumeric, got {self.tag!r}")

    @property
    def request_prefix(self) -> str:
        """``req-<tag>-``: how every request id of the run starts."""
        return f"req-{self.tag}-"


@dataclass(frozen=True)
class Finding:
    """What a census counted or a reclaim freed in one connector instance's backend.

    ``what`` is a plural noun as in ``"shm file(s)"``; ``where`` where they are (``"in /dev/shm"``);
    ``sample`` a few names for the report; ``removed``: the census had to remove them to count
    them (a store that cannot count keys by pattern without taking them).
    """

    count: int
    what: str
    where: str = ""
    sample: tuple[str, ...] = ()
    removed: bool = False

    def census_line(self) -> str:
        """``3 shm file(s) left in /dev/shm: ['a', 'b', 'c']`` (``(removed)`` appended where the census removed them)."""
        text = f"{self.count} {self.what} left" + (f" {self.where}" if self.where else "")
        if self.sample:
            text += f": {list(self.sample)}"
        return text + (" (removed)" if self.removed else "")

    def reclaim_line(self) -> str:
        """``removed 3 Redis key(s) of this run``."""
        return f"removed {self.count} {self.what}" + (f" {self.where}" if self.where else "")


@runtime_checkable
class PrivateServer(Protocol):
    """A backend server started for one run, benchmark or test session: loopback only, a free port, stopped by pid."""

    @property
    def pid(self) -> int | None:
        """The server process (None once stopped)."""

    @property
    def address(self) -> str:
        """``host:port`` (or a socket path): for reports; it carries no secret."""

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        """A connector config (a stage's ``extra`` mapping) that reaches this server, with ``overrides`` applied."""

    def stop(self) -> None:
        """Stop the process by pid and remove what it wrote. Idempotent."""


class RawBaseline(Protocol):
    """One end of a raw baseline: the same bytes through the backend without the connector.

    ``omni-plugins bench`` runs two ends in two processes, each with its own connections:
    the producer's end ``put``\\ s a uint8 tensor under a key, the consumer's end ``get``\\ s it
    and owns a copy (a tensor of ``nbytes`` that stays valid after the next get). The time
    from the start of the put to the end of the get is one sample, measured alike for the
    connector; their ratio is the connector's cost. Use the backend's own client in its
    fastest plain way: no codec, no protocol of ours. ``handshake`` data (JSON-able) crosses
    to the other end once, before the first put, and arrives in its ``connect``.
    """

    def handshake(self) -> Mapping[str, Any]: ...

    def connect(self, peer: Mapping[str, Any]) -> None: ...

    def put(self, key: str, payload: torch.Tensor) -> None: ...

    def get(self, key: str, nbytes: int) -> torch.Tensor: ...

    def close(self) -> None: ...
