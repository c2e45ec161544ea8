"""The connector contract every backend plugin implements.

A connector moves one payload per key between two stages. ``put`` stores, ``get``
retrieves (and by default consumes), ``cleanup`` frees a key that will never be
read, ``health`` reports status, ``close`` releases everything the instance owns.
``put_many`` stores one payload under several keys (a fan-out); a backend that
can encode the payload once for all of them overrides ``_put_many``.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from omni_plugins.backoff import Backoff
from omni_plugins.errors import ConnectorClosedError, ConnectorContractError

StageId = int | str


class PutResult(NamedTuple):
    """Outcome of :meth:`Connector.put`: success, serialized size in bytes, optional metadata."""

    ok: bool
    size: int
    metadata: dict[str, Any] | None = None


def failed_put(exc: BaseException) -> PutResult:
    """The :class:`PutResult` of one target of :meth:`Connector.put_many` that failed with ``exc``.

    ``metadata["error"]`` says why (as ``put``'s ``ok=False`` results do);
    ``metadata["exception"]`` keeps the exception, so a caller can tell a
    failure a retry may mend from one it cannot (a closed connector, a payload
    that cannot be encoded).
    """
    return PutResult(False, 0, {"error": f"{type(exc).__name__}: {exc}", "exception": exc})


class PutTarget(NamedTuple):
    """One destination of :meth:`Connector.put_many`: the edge and the key."""

    from_stage: StageId
    to_stage: StageId
    key: str


class GetResult(NamedTuple):
    """Outcome of a successful :meth:`Connector.get`: the decoded payload and its serialized size."""

    data: Any
    size: int


@dataclass(frozen=True)
class Capabilities:
    """What a runtime may rely on beyond the basic contract.

    Attributes:
        blocking_get: ``get(..., timeout=t)`` waits for the key without the caller
            polling; a runtime should block on it instead of sleeping between polls.
        cross_process: a payload put in one process can be read in another.
        cross_host: a payload can cross machines.
        zero_copy_get: ``get`` can hand out views over backend memory.
        consume_on_get: a successful ``get`` removes the payload.
        wait_any: :meth:`Connector.wait_any` waits for *any* of several keys
            without polling (one waiter can watch every pending key). Without
            it the base class's fallback polls (or merely sleeps), so a runtime
            should keep its own strategy.
        interrupt_wait: :meth:`Connector.interrupt_wait` makes a ``wait_any`` of
            this instance return early (at once if it is blocked, else the next
            one returns at once), so a waiter can wait with a long bound and
            still react to news of its own (a new key to wait for) at once.
            Without it ``interrupt_wait`` does nothing and a wait ends at its
            bound: a runtime should then keep its bound short.
        poll_any: :meth:`Connector.poll_any` busy-polls (no sleep, a core
            burnt, the GIL let go) instead of sleeping like ``wait_any``. Without
            it ``poll_any`` is ``wait_any``, so a runtime should not wake up
            early to poll.
        wait_any_sets: ``_wait_any`` and ``_poll_any`` take the keys as the
            caller passed them -- a set, or a dict's keys view -- and look up
            in them rather than walking them, so a wait's cost does not grow
            with the number of keys waited on. A runtime watching many streams
            can then pass its live table of pending keys instead of copying it
            into a list for every wait. Without it the base class hands the
            primitives a list.
    """

    blocking_get: bool = False
    cross_process: bool = False
    cross_host: bool = False
    zero_copy_get: bool = False
    consume_on_get: bool = True
    wait_any: bool = False
    interrupt_wait: bool = False
    poll_any: bool = False
    wait_any_sets: bool = False


#: fallback ``wait_any`` without an existence check sleeps at most this long per call
_WAIT_ANY_BLIND_S = 0.005
#: fallback ``wait_any`` with an existence check: first and largest pause between checks
_WAIT_ANY_BACKOFF = (0.0005, 0.02)


class Connector(abc.ABC):
    """Abstract base of all connectors.

    Subclasses implement the ``_put``/``_get``/``_cleanup``/``_close`` primitives;
    this class provides closed-state checking, idempotent ``close`` and the
    context-manager protocol. ``name`` is filled in by the registry.
    """

    name: str = "connector"
    capabilities: Capabilities = Capabilities()

    #: whether this class's ``_put_many`` was written together with its ``put``/``_put`` (see ``__init_subclass__``)
    _put_many_current = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._put_many_current = _put_many_is_current(cls)

    def __init__(self) -> None:
        self._closed = False
        self._close_lock = threading.Lock()

    # -- public contract ---------------------------------------------------
    def put(self, from_stage: StageId, to_stage: StageId, key: str, data: Any) -> PutResult:
        """Store ``data`` under ``key`` for the edge ``from_stage -> to_stage``."""
        self._check_open()
        result = self._put(str(from_stage), str(to_stage), key, data)
        if not isinstance(result, PutResult):
            raise ConnectorContractError(self._wrong_return("_put", result, "a PutResult"))
        return result

    def put_many(self, targets: Sequence[tuple[StageId, StageId, str]], data: Any) -> list[PutResult]:
        """Store the same ``data`` under every target ``(from_stage, to_stage, key)``: a fan-out.

        Each key then holds its own payload, exactly as after one ``put`` per
        target (each is read, consumed and cleaned up on its own); a backend
        that overrides :meth:`_put_many` encodes the payload once for all of
        them. Returns one :class:`PutResult` per target, in order: a target
        that failed has ``ok=False`` and ``metadata["error"]`` (see
        :func:`failed_put`), while the others may have succeeded, so a caller
        retries only the failed ones. Raises only when no target was stored
        (the connector is closed; a backend that encodes up front: a payload
        that cannot be encoded).
        """
        self._check_open()
        if not targets:
            return []
        edges = [(str(f), str(t), k) for f, t, k in targets]
        results = self._put_many(edges, data) if self._put_many_current else Connector._put_many(self, edges, data)
        if not isinstance(results, list) or len(results) != len(edges) or not all(isinstance(r, PutResult) for r in results):
            raise ConnectorContractError(self._wrong_return("_put_many", results, f"a list of {len(edges)} PutResult(s)"))
        return results

    def get(self, from_stage: StageId, to_stage: StageId, key: str, *, timeout: float | None = None) -> GetResult | None:
        """Return the payload stored under ``key``, or None when it is absent.

        With ``timeout`` (seconds) wait up to that long for the key to arrive.
        """
        self._check_open()
        result = self._get(str(from_stage), str(to_stage), key, timeout)
        if result is not None and not isinstance(result, GetResult):
            raise ConnectorContractError(self._wrong_return("_get", result, "a GetResult(data, size) or None"))
        return result

    def wait_any(self, keys: Collection[str], timeout: float) -> list[str]:
        """Block until at least one of ``keys`` is probably available, or ``timeout`` seconds pass.

        Returns the keys that became available (empty on timeout). A hint, not a
        claim: the result may be spurious or stale (another consumer may win the
        key), so the caller still takes each key with a non-blocking ``get``.
        Nothing is consumed. ``timeout`` is required and bounded: there is no
        wait forever. Cheap and precise only with ``capabilities.wait_any``.
        ``keys`` is any collection; with ``capabilities.wait_any_sets`` a set or
        a dict's keys view is looked up, not walked (the caller must not change
        it during the call).
        """
        self._check_open()
        if not keys:
            return []
        return self._wait_any(self._wait_keys(keys), max(0.0, float(timeout)))

    def _wait_keys(self, keys: Collection[str]) -> Sequence[str]:
        """``keys`` as the wait primitives take them: as given with ``capabilities.wait_any_sets``, else a list."""
        if self.capabilities.wait_any_sets or isinstance(keys, (list, tuple)):
            return keys  # type: ignore[return-value]  # a Collection where the connector said it takes one
        return list(keys)

    def poll_any(self, keys: Collection[str], timeout: float) -> list[str]:
        """:meth:`wait_any` that busy-polls instead of sleeping (with ``capabilities.poll_any``).

        For waits of a millisecond or two right before an arrival the caller
        expects: a sleeping waiter's CPU goes idle, and on a virtual machine
        the wake-up and the code after it then run cold (several times slower
        than warm); a poll keeps the core busy and the caches warm. It burns
        that core meanwhile (the GIL is let go, so other threads run), so the
        caller bounds how often and how long it polls. ``interrupt_wait`` ends
        a poll as it ends a wait. Without the capability this is ``wait_any``.
        """
        self._check_open()
        if not keys:
            return []
        return self._poll_any(self._wait_keys(keys), max(0.0, float(timeout)))

    def interrupt_wait(self) -> None:
        """Make the ``wait_any`` blocked in this instance return early (thread-safe).

        With ``capabilities.interrupt_wait`` the blocked wait returns at once
        (the keys found so far, often ``[]``); if no wait is blocked, the next
        ``wait_any`` of this instance returns at once instead (one pending
        interrupt, not counted: several calls before a wait end one wait), so an
        interrupt made just before a wait starts is not lost. Without the
        capability this does nothing: a wait ends at its bound. Never raises,
        also not on a closed connector (a closed connector's waits end anyway).
        """
        if not self._closed:
            self._interrupt_wait()

    def cleanup(self, key: str) -> bool:
        """Free the payload under ``key`` (if any). Returns True when something was freed."""
        self._check_open()
        return self._cleanup(key)

    def health(self) -> dict[str, Any]:
        """A JSON-able status dict; always contains ``ok`` and ``connector``."""
        if self._closed:
            return {"ok": False, "connector": self.name, "closed": True}
        status = {"ok": True, "connector": self.name}
        extra = self._health()
        if not isinstance(extra, dict):
            raise ConnectorContractError(self._wrong_return("_health", extra, "a dict"))
        status.update(extra)
        return status

    def close(self) -> None:
        """Release everything this instance owns. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- primitives for subclasses ----------------------------------------
    @abc.abstractmethod
    def _put(self, from_stage: str, to_stage: str, key: str, data: Any) -> PutResult: ...

    def _put_many(self, targets: list[tuple[str, str, str]], data: Any) -> list[PutResult]:
        """Primitive of :meth:`put_many` (stage ids as strings); the default is :meth:`put` per target.

        Each of those puts encodes the payload again. A backend that can do
        better (encode once, write every key in one round trip) overrides this;
        a failed target must become its :func:`failed_put` result, not an
        exception, once any other target may have been stored.
        """
        results: list[PutResult] = []
        for from_stage, to_stage, key in targets:
            try:
                results.append(self.put(from_stage, to_stage, key, data))
            except Exception as exc:
                results.append(failed_put(exc))
        return results

    @abc.abstractmethod
    def _get(self, from_stage: str, to_stage: str, key: str, timeout: float | None) -> GetResult | None: ...

    @abc.abstractmethod
    def _cleanup(self, key: str) -> bool: ...

    def _wait_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        """Fallback for connectors without ``capabilities.wait_any``.

        With a cheap existence check (:meth:`_available` not returning None) it
        polls that check with exponential backoff (0.5 ms doubling to 20 ms)
        until a key shows up or the timeout passes. Without one it cannot know:
        it sleeps ``min(timeout, 5 ms)`` and returns every key as *possibly*
        available -- a bounded poll, the caller's ``get`` decides.
        """
        backoff = Backoff.within(timeout, *_WAIT_ANY_BACKOFF)
        while True:
            found = self._available(keys)
            if found is None:
                time.sleep(min(timeout, _WAIT_ANY_BLIND_S))
                return list(keys)
            if found or self._closed or not backoff.sleep():
                return found

    def _available(self, keys: Sequence[str]) -> list[str] | None:
        """Optional cheap existence check used by the fallback ``_wait_any``: the keys present now.

        None (the default) means the connector has no such check.
        """
        return None

    def _poll_any(self, keys: Sequence[str], timeout: float) -> list[str]:
        """Primitive of :meth:`poll_any`; connectors with ``capabilities.poll_any`` override it."""
        return self._wait_any(keys, timeout)

    def _interrupt_wait(self) -> None:
        """Primitive of :meth:`interrupt_wait` for connectors with ``capabilities.interrupt_wait``."""
        return None

    def _health(self) -> dict[str, Any]:
        return {}

    def _close(self) -> None:
        return None

    def _wrong_return(self, primitive: str, value: object, expected: str) -> str:
        """The message for a primitive that broke the contract (a plugin bug): names the connector and its class."""
        cls = type(self)
        return (
            f"connector {self.name!r} ({cls.__module__}.{cls.__qualname__}): {primitive}() returned "
            f"{type(value).__name__} {value!r:.80}, expected {expected}"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError(f"connector {self.name!r} is closed; create a new one")


def _put_many_is_current(cls: type) -> bool:
    """Whether ``cls``'s ``_put_many`` comes from the class that defines its ``put``/``_put``, or from a subclass of it.

    A subclass that overrides ``_put`` or ``put`` below the class that wrote
    ``_put_many`` (a wrapper that counts, logs or injects faults) would be
    bypassed by that ``_put_many``: it gets the base class's loop over ``put``
    instead, so every put still goes through its override.
    """
    mro = cls.__mro__

    def depth(name: str) -> int:
        return next(i for i, c in enumerate(mro) if name in c.__dict__)

    return depth("_put_many") <= min(depth("_put"), depth("put"))
