"""The receive thread: finds each registered request's next key and hands arrivals over.

Both modes sweep every registered request's next key with a non-blocking
``get``, at an interval that starts at ``poll_min_s`` and doubles up to
``poll_max_s`` while sweeps find nothing (reset when one does), and never
spend more than ~10% of a core on sweeping. They differ in how the time
between sweeps is spent:

* **poll** sleeps (a registration wakes it).
* **block, wait-any** (connectors with ``capabilities.wait_any``, unless
  ``RuntimeTuning.wait_any`` is off) does not sweep on a schedule: it waits
  in one ``connector.wait_any`` on the next key of every pollable request
  (bounded by ``_WAIT_ANY_MAX_S``, so deadlines, registrations and shutdown
  are seen; by ``_WAIT_ANY_INTERRUPTIBLE_S`` when the connector has
  ``capabilities.interrupt_wait``: then :meth:`Receiver.notify` cuts the wait
  short) and takes the keys it reports with non-blocking ``get``s, in any
  order. A sweep every ``_SAFETY_SWEEP_S`` over the requests quiet for
  ``_QUIET_S`` is the safety net against a missed notification; reported
  keys that turn out absent back the waits off (``poll_min_s`` doubling to
  ``poll_max_s``) so a connector whose hint is wrong cannot spin the thread.
* **block, park-one** (connectors with only ``capabilities.blocking_get``)
  parks in a blocking ``get`` on the request most likely to be next -- the earliest
  expected arrival (last arrival plus its running inter-arrival gap) -- until
  the next sweep is due. Periodic streams (a chunk every N tokens, every
  stream once per model step) are then taken the moment they land, one
  ``get`` per chunk; arrivals out of the predicted order wait at most one
  sweep interval, exactly as in poll mode.

Every ``get`` has a timeout, so shutdown and a dead peer never hang the thread.
Deadlines (``recv_timeout_s`` since registration or the last arrival) are
checked at most every ``_EXPIRY_EVERY_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from omni_plugins.backoff import Backoff
from omni_plugins.contract import Connector
from omni_plugins.errors import ConnectorContractError, TransientConnectorError, WireFormatError
from omni_plugins.metrics import NO_OBSERVER
from omni_plugins.runtime.backlog import CleanupBacklog
from omni_plugins.runtime.rhythm import ArrivalRhythm
from omni_plugins.runtime.state import InputState, RequestRegistry
from omni_plugins.runtime.threads import preemptions, thread_cpu_seconds
from omni_plugins.runtime.tuning import RuntimeTuning

logger = logging.getLogger(__name__)

#: how often deadlines are checked (they are seconds to minutes long)
_EXPIRY_EVERY_S = 0.1
#: a request this much overdue (and more than two of its gaps) stops being the park target
_STALL_S = 0.05
#: longest single wait_any: a new registration joins the waited set within this
_WAIT_ANY_MAX_S = 0.01
#: ... with a connector whose waits :meth:`notify` can interrupt (a registration joins at once);
#: deadlines are checked every ``_EXPIRY_EVERY_S`` anyway
_WAIT_ANY_INTERRUPTIBLE_S = 0.1
#: wait-any mode: sweep this often, in case a connector's notification was missed ...
_SAFETY_SWEEP_S = 1.0
#: ... over the requests that received nothing (nor registered) for this long
_QUIET_S = 0.5
#: wait-any mode: an arrival after this much silence starts a new burst (see :mod:`rhythm`)
_BURST_GAP_S = 0.002
#: after a get failed for a passing reason (``TransientConnectorError``): the receive thread's first and
#: longest pause before it looks again (doubling while gets keep failing so, reset by the next arrival)
_TRANSIENT_BACKOFF_S = (0.001, 0.1)


#: keys to free, per connector (a fan-in request's inputs may come over different connectors)
KeysToFree = list[tuple[Connector, list[str]]]


class ArrivalHandler(Protocol):
    """What the receive thread calls, always under the registry lock."""

    def pollable(self, entry: InputState) -> bool: ...

    def recv_key(self, entry: InputState) -> str: ...

    def on_payload(self, entry: InputState, payload: Any) -> None: ...

    def on_failure(self, entry: InputState, *, timed_out: bool) -> KeysToFree:
        """Drop the request; return connector keys to clean (outside the lock)."""
        ...

    def publish(self) -> None:
        """Wake the model thread for what ``on_payload``/``on_failure`` delivered (once per batch)."""
        ...

    def unread(self) -> bool:
        """Something delivered earlier is still waiting for the model thread (read without the lock)."""
        ...


class Receiver:
    """Owns one receive thread of a runtime: the input routes over one connector.

    A runtime has one receiver per connector instance its input edges use (one
    for a single input edge; a fan-in stage whose sources share a connector
    waits on all of them in one ``wait_any``).
    """

    def __init__(
        self,
        connector: Connector,
        registry: RequestRegistry,
        handler: ArrivalHandler,
        *,
        routes: Sequence[int],
        tuning: RuntimeTuning,
        name: str = "omni-recv",
        cleanup_backlog: CleanupBacklog | None = None,
    ) -> None:
        self._connector = connector
        self._backlog = cleanup_backlog if cleanup_backlog is not None else CleanupBacklog()
        self._registry = registry
        self._handler = handler
        #: the input routes (``InputRoute.index``) this thread serves
        self._routes = tuple(routes)
        self._tuning = tuning
        mode = tuning.arrival
        if mode == "auto":
            mode = "block" if connector.capabilities.blocking_get else "poll"
        self.mode = mode
        #: block mode waits on every pending key at once (connector's wait_any)
        self.waits_any = mode == "block" and tuning.wait_any and connector.capabilities.wait_any
        self._consume = connector.capabilities.consume_on_get
        #: wait-any mode over a connector whose waits notify() can cut short: long waits, no idle wake-ups
        self.interrupts = self.waits_any and connector.capabilities.interrupt_wait
        self._wait_bound = _WAIT_ANY_INTERRUPTIBLE_S if self.interrupts else _WAIT_ANY_MAX_S
        #: wait-any mode over a connector that can busy-poll: poll right before each expected burst
        self.rhythm: ArrivalRhythm | None = None
        if self.waits_any and connector.capabilities.poll_any and tuning.anticipate_s > 0:
            self.rhythm = ArrivalRhythm(
                lead_s=tuning.anticipate_s,
                after_s=tuning.anticipate_after_s,
                burst_gap_s=_BURST_GAP_S,
                max_duty=tuning.anticipate_max_duty,
            )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_error_log = 0.0
        #: pauses after gets that failed for a passing reason (see :meth:`_transient`)
        self._shortage = Backoff(*_TRANSIENT_BACKOFF_S)
        self._next_expiry = 0.0
        #: wait-any mode: the registry epoch the waited set reflects (see :meth:`_deliver`)
        self._epoch = -1
        self.stats = {
            "sweeps": 0,
            "gets": 0,
            "arrivals": 0,
            "parks": 0,
            "park_hits": 0,
            "waits": 0,
            "wait_hits": 0,
            "wait_spurious": 0,
            "wait_empty": 0,
            "plans": 0,  # wait-any mode: rebuilds of the waited set
            "polls": 0,  # wait-any mode: busy-polls before an expected burst (``RuntimeTuning.anticipate_s``)
            "poll_hits": 0,  # ... that saw an arrival
            "polls_preempted": 0,  # ... during which the thread lost its core (many: polling pauses, see :mod:`rhythm`)
            "errors": 0,
            "transient": 0,  # gets that failed for a passing reason (the payload kept; retried with backoff)
        }
        self._thread = threading.Thread(target=self._run_wait_any if self.waits_any else self._run, name=name, daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """Something was registered: look now (cuts a running ``wait_any`` short where the connector can)."""
        self._wake.set()
        if self.interrupts:
            self._interrupt()

    def _interrupt(self) -> None:
        try:
            self._connector.interrupt_wait()
        except Exception:  # the contract says it never raises; a wait still ends at its bound
            logger.debug("interrupt_wait failed", exc_info=True)

    def cpu_seconds(self) -> float | None:
        """CPU time the receive thread has used so far (None once it ended, or where the OS cannot tell)."""
        return thread_cpu_seconds(self._thread)

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("receive thread did not stop within %.1fs", timeout)

    # -- thread -----------------------------------------------------------------
    def _plan(self) -> list[tuple[InputState, int, str]]:
        """Expire deadlines, then list (state, index, key) of every request to look for."""
        self._expire()
        with self._registry.lock:
            return self._plan_locked()

    def _plan_locked(self) -> list[tuple[InputState, int, str]]:
        handler = self._handler
        return [(s, s.next_recv_chunk, handler.recv_key(s)) for s in self._registry.receiving_iter(self._routes) if handler.pollable(s)]

    def _expire(self) -> None:
        """Drop requests whose wait exceeded their timeout (at most every ``_EXPIRY_EVERY_S``)."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + _EXPIRY_EVERY_S
        cleanup: KeysToFree = []
        with self._registry.lock:
            for state in self._registry.receiving(self._routes):
                if state.registered and state.deadline is not None and state.deadline <= now:
                    logger.warning(
                        "request %s waited more than its timeout for chunk %d from stage %s; dropping it",
                        state.request_id,
                        state.next_recv_chunk,
                        state.source,
                    )
                    state.route.observer.failed("timeout", finished=False)
                    cleanup += self._handler.on_failure(state, timed_out=True)
            self._handler.publish()  # a no-op unless something timed out
        self._cleanup(cleanup)

    def _target(self) -> tuple[InputState, int, str] | None:
        """The request most likely to receive next: the earliest expected arrival.

        A request is expected ``arrival_gap`` after its last arrival (or its
        registration). One overdue by more than two gaps (at least ``_STALL_S``)
        is treated as stalled and expected one gap from now, so a silent
        producer does not hold the receive thread. Scanning goes oldest last
        arrival first and stops at the first request already due.
        """
        now = time.monotonic()
        best: InputState | None = None
        best_at = float("inf")
        with self._registry.lock:
            for state in self._registry.receiving_iter(self._routes):
                if not self._handler.pollable(state):
                    continue
                gap = state.arrival_gap
                expected = state.last_arrival + gap
                if now - expected > max(2 * gap, _STALL_S):
                    expected = now + max(gap, _STALL_S)
                if expected < best_at:
                    best, best_at = state, expected
                    if expected <= now:
                        break
            return None if best is None else (best, best.next_recv_chunk, self._handler.recv_key(best))

    def _cleanup(self, keys: KeysToFree) -> None:
        """Free keys of a dropped request; they are sequential, so the first miss ends the scan
        (a backend error keeps the rest for a retry at shutdown)."""
        for connector, scan in keys:
            self._backlog.free_in_order(connector, scan)

    def _cleanup_one(self, key: str) -> bool:
        try:
            return bool(self._connector.cleanup(key))
        except Exception:
            logger.debug("cleanup of %s failed", key, exc_info=True)
            return False

    def _sweep(self, batch: list[tuple[InputState, int, str]]) -> bool:
        self.stats["sweeps"] += 1
        progress = False
        stats = self.stats
        shortages = stats["transient"]
        for item in batch:
            if self._stop.is_set() or stats["transient"] != shortages:
                break  # a get ran short (and paused): the rest would too; the next sweep looks again
            progress = self._fetch(*item, timeout=None) or progress
        return progress

    def _run(self) -> None:
        t = self._tuning
        delay = t.poll_min_s  # sweep interval: grows while sweeps find nothing, reset when one does
        next_sweep = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_sweep:
                    batch = self._plan()
                    if not batch:
                        self._wake.wait(0.05)
                        self._wake.clear()
                        continue
                    cpu = time.thread_time()
                    progress = self._sweep(batch)
                    cost = time.thread_time() - cpu
                    delay = t.poll_min_s if progress else min(delay * 2, t.poll_max_s)
                    # never let sweeping take more than ~10% of a core (one get per request each)
                    next_sweep = time.monotonic() + max(delay, 9 * cost)
                    if progress:
                        continue
                if self.mode == "block":
                    target = self._target()
                    if target is not None:
                        self.stats["parks"] += 1
                        if self._fetch(*target, timeout=max(next_sweep - time.monotonic(), 1e-4)):
                            self.stats["park_hits"] += 1
                        continue
                self._wake.wait(max(next_sweep - time.monotonic(), 0.0))
                if self._wake.is_set():
                    self._wake.clear()
                    next_sweep = 0.0  # a registration: look now
            except Exception:  # never let the thread die
                logger.exception("receive loop error")
                self._stop.wait(t.poll_max_s)

    def _run_wait_any(self) -> None:
        """Block mode over ``connector.wait_any``: wait on every pending key, take what is reported.

        The waited set (next key -> request) is rebuilt only when the set of
        receiving requests changed (registry ``epoch``) by another thread or
        :meth:`notify` was called; after an arrival only that request's entry
        moves to its next key (or leaves, when its stream ended: this thread's
        own epoch bumps need no rebuild). The keys a wait reports are taken one by one; each goes to the
        model thread at once if it has read everything before, else with the
        others under one lock hold (see :meth:`_take_reported`). A connector with
        ``capabilities.wait_any_sets`` is handed the waited set itself (a keys
        view: no copy, and a look whose cost does not grow with the streams).
        """
        t = self._tuning
        as_set = self._connector.capabilities.wait_any_sets
        next_sweep = 0.0
        backoff = t.poll_min_s
        pending: dict[str, tuple[InputState, int]] = {}
        self._epoch = -1
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= self._next_expiry:
                    self._expire()
                if self._wake.is_set() or self._registry.epoch != self._epoch:
                    self._wake.clear()  # registrations made so far are in this plan
                    self.stats["plans"] += 1
                    with self._registry.lock:
                        self._epoch = self._registry.epoch
                        pending = {key: (state, index) for state, index, key in self._plan_locked()}
                if not pending:
                    self._wake.wait(0.05)
                    continue
                if now >= next_sweep:
                    next_sweep = now + _SAFETY_SWEEP_S
                    # only requests that received nothing for a while: a missed notification leaves its
                    # request quiet; streams that keep arriving are evidently being reported
                    quiet = [(state, index, key) for key, (state, index) in pending.items() if now - state.last_arrival >= _QUIET_S]
                    if quiet:
                        self._epoch = -1  # a sweep may move requests on: re-plan
                        if self._sweep(quiet):
                            continue
                self.stats["waits"] += 1
                try:
                    keys = pending.keys() if as_set else list(pending)
                    ready = self._wait(keys, min(self._wait_bound, max(next_sweep - now, 0.0)), now)
                except Exception as exc:  # a backend failure: keep going (deadlines still fire)
                    self.stats["errors"] += 1
                    self._log_failure("wait_any", exc, "retrying until the requests time out")
                    self._stop.wait(t.poll_max_s)
                    continue
                if not ready:
                    self.stats["wait_empty"] += 1
                    continue
                if self._take_reported(ready, pending):
                    self.stats["wait_hits"] += 1
                    backoff = t.poll_min_s
                else:  # reported but not there (taken by someone else, or a wrong hint): do not spin
                    self.stats["wait_spurious"] += 1
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, t.poll_max_s)
            except Exception:  # never let the thread die
                logger.exception("receive loop error")
                self._stop.wait(t.poll_max_s)

    def _wait(self, keys: Collection[str], bound: float, now: float) -> list[str]:
        """``connector.wait_any`` up to ``bound``; with a learnt rhythm, ``poll_any`` through the window of the next burst."""
        rhythm = self.rhythm
        if rhythm is None or (window := rhythm.window(now)) is None:
            ready = self._connector.wait_any(keys, bound)
        else:
            poll_from, poll_until = window
            ready = self._connector.wait_any(keys, min(bound, poll_from - now)) if now < poll_from else []
            if not ready and poll_from <= (now := time.monotonic()) < poll_until:
                self.stats["polls"] += 1
                count = preemptions
                switches = 0 if count is None else count()
                ready = self._connector.poll_any(keys, poll_until - now)
                self.stats["poll_hits"] += bool(ready)
                if count is not None:
                    preempted = count() > switches
                    self.stats["polls_preempted"] += preempted
                    rhythm.polled(preempted, time.monotonic())
        if ready and rhythm is not None:
            rhythm.arrived(time.monotonic())
        return ready

    def _take_reported(self, keys: list[str], pending: dict[str, tuple[InputState, int]]) -> bool:
        """Take the keys a wait reported and deliver them; True if any was there.

        A chunk is handed over as soon as the model thread has read everything
        delivered before it (it is idle, waiting for news) -- not after the gets
        of the other reported keys, which would hold it back by one ``get``
        each; chunks taken while the model thread is still busy with an earlier
        delivery gather and go over together when it is done or at the end.
        """
        taken: list[tuple[InputState, int, str, Any]] = []
        found = False
        unread = self._handler.unread
        stop = self._stop
        stats = self.stats
        shortages = stats["transient"]
        for key in keys:
            item = pending.get(key)
            if item is None or stop.is_set():
                continue
            got = self._take(item[0], item[1], key, timeout=None)
            if got is _ABSENT:
                if stats["transient"] != shortages:
                    break  # it ran short (and paused): so would the others; the next wait reports them again
                continue
            found = True
            taken.append((item[0], item[1], key, got))
            if not unread():
                self._deliver(taken, pending)
                taken = []
        if taken:
            self._deliver(taken, pending)
        return found

    def _fetch(self, state: InputState, index: int, key: str, *, timeout: float | None) -> bool:
        """Take one key and deliver it (park-one and poll modes)."""
        got = self._take(state, index, key, timeout=timeout)
        if got is _ABSENT:
            return False
        self._deliver([(state, index, key, got)])
        return True

    def _take(self, state: InputState, index: int, key: str, *, timeout: float | None) -> Any:
        """The connector I/O of one arrival (no lock held): the payload, ``_UNDECODABLE`` or ``_ABSENT``."""
        self.stats["gets"] += 1
        try:
            result = self._connector.get(*state.route.edge, key, timeout=timeout)
        except (WireFormatError, ConnectorContractError) as exc:  # retrying gets the same bytes, or the same plugin bug
            why = "cannot be decoded" if isinstance(exc, WireFormatError) else "came from a get that broke the connector contract"
            state.route.observer.failed("decode" if isinstance(exc, WireFormatError) else "contract", finished=False)
            logger.error("payload under %s %s; request %s reported failed", key, why, state.request_id, exc_info=True)
            self._cleanup_one(key)
            return _UNDECODABLE
        except TransientConnectorError as exc:
            self._transient(key, exc)
            return _ABSENT
        except Exception as exc:
            self.stats["errors"] += 1
            self._log_failure(f"get of {key}", exc, "retrying until the request times out")
            return _ABSENT
        if result is None:
            return _ABSENT
        if self._shortage.delay != self._shortage.first:
            self._shortage.reset()  # an arrival: the shortage has passed
        if not self._consume:
            self._cleanup_one(key)
        self.stats["arrivals"] += 1
        observer = state.route.observer
        if observer is not NO_OBSERVER:
            observer.delivered(result.size, finished=False)
        return result.data

    def _log_failure(self, what: str, exc: Exception, what_now: str) -> None:
        """``what failed (what_now): error``, one warning per second at most (the traceback too when logging at INFO)."""
        now = time.monotonic()
        if now - self._last_error_log > 1.0:
            self._last_error_log = now
            logger.warning("%s failed (%s): %s: %s", what, what_now, type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.INFO))

    def _transient(self, key: str, exc: TransientConnectorError) -> None:
        """A get failed for a passing reason (the reader ran short of descriptors or memory) and left the payload in place.

        The request is not failed: the key is looked for again like any missing one, until the
        request's deadline. The shortage is the process's, not the key's -- every get of it would
        meet it -- so the thread pauses (doubling from 1 ms to 100 ms while gets keep failing so,
        back to 1 ms after the next arrival) instead of retrying at once, which would spin while
        whatever holds the resource lets go of it, and the other keys of the same look wait for the
        next one. Stopping cuts the pause short.
        """
        self.stats["errors"] += 1
        self.stats["transient"] += 1
        self._log_failure(f"get of {key}", exc, "the payload is kept; retrying with backoff until the request times out")
        self._shortage.sleep(self._stop.wait)

    def _fail_taken(self, state: InputState, index: int) -> KeysToFree:
        """Lock held: chunk ``index`` of ``state`` was taken (consumed) but is unusable: fail the request.

        Its later chunks are cleaned from ``index + 1`` on (the cleanup scan stops at the first
        missing key, and chunk ``index`` is gone already).
        """
        state.next_recv_chunk = index + 1
        return self._handler.on_failure(state, timed_out=False)

    def _deliver(self, taken: list[tuple[InputState, int, str, Any]], pending: dict[str, tuple[InputState, int]] | None = None) -> None:
        """Hand taken payloads over under one lock hold, wake the model thread once.

        ``pending`` (wait-any mode): move each request's entry to its next key.
        """
        if not taken:
            return
        cleanup: KeysToFree = []
        handler = self._handler
        registry = self._registry
        with registry.lock:
            epoch0 = registry.epoch
            for state, index, key, data in taken:
                if not (state.registered and state.next_recv_chunk == index and registry.get(state.request_id) is state.request):
                    logger.debug("dropping %s: request %s is gone or moved on", key, state.request_id)
                elif data is _UNDECODABLE:
                    cleanup += self._fail_taken(state, index)
                else:
                    try:
                        handler.on_payload(state, data)
                    except Exception:
                        # a payload that decodes but breaks the payload rules (untrusted bytes): this
                        # request failed; the others in the batch, already taken from the connector, go on
                        logger.error("payload under %s is malformed; request %s reported failed", key, state.request_id, exc_info=True)
                        state.route.observer.failed("malformed", finished=False)
                        cleanup += self._fail_taken(state, index)
                if pending is not None:
                    pending.pop(key, None)
                    if state.registered and handler.pollable(state):
                        pending[handler.recv_key(state)] = (state, state.next_recv_chunk)
            if pending is not None and self._epoch == epoch0:
                # the epoch moved only by what this hold did (a stream ended, a request dropped), and
                # ``pending`` already follows it: no re-plan of every receiving request for that
                self._epoch = registry.epoch
            handler.publish()
        if cleanup:
            self._cleanup(cleanup)


#: :meth:`Receiver._take` results that are not payloads
_ABSENT = object()
_UNDECODABLE = object()
