"""The send thread: per-request ordered queues, round-robin across requests, retries.

Tasks of one request are put in order (one send thread, one task of a request
at a time). A ``put`` that fails or raises goes back to the front of its
request's queue, after a short backoff, up to ``max_retries`` times; then it is
dropped, logged and the request reported as failed. Each request counts its
sends in flight; a request released by cleanup while sends are in flight is
freed when the last one completes. An aborted request's queued puts are
dropped and, once its running put (if any) completed, every key it put is
freed from the connector (nobody will read them).

Fan-out: the tasks of one payload to several destinations are taken in the
same round; those whose routes share a connector instance go in one
``put_many`` (encoded once where the backend can), booked per task as if each
had its own ``put``.

Hand-over: the model thread keeps the GIL while it builds a step's chunks, so
a send thread that was merely woken would start the step's puts after the
last ``send_chunk`` -- a step of n chunks then waits for n builds and up to n
puts. :meth:`Sender.hand_over` lets ``send_chunk`` wait (briefly, see
``RuntimeTuning.send_handoff_s``) until the send thread has taken the chunk:
the put starts at once and the next build overlaps its syscalls.
"""

from __future__ import annotations

import logging
import threading
import time
from _thread import allocate_lock as _allocate_lock
from collections import deque
from collections.abc import Sequence
from typing import Any

from omni_plugins.contract import Connector, PutResult
from omni_plugins.metrics import NO_OBSERVER
from omni_plugins.runtime.backlog import CleanupBacklog
from omni_plugins.runtime.routes import OutputRoute
from omni_plugins.runtime.state import RequestRegistry, RequestState, SendTask
from omni_plugins.runtime.threads import thread_cpu_seconds
from omni_plugins.runtime.wakeflag import WakeFlag

logger = logging.getLogger(__name__)

#: most puts the send thread makes per lock round (their completions are booked together)
_BATCH = 16
#: weight of the newest put in the running mean of put durations (hand-over gate)
_PUT_EWMA_WEIGHT = 0.2


class Sender:
    """Owns the send thread of one runtime: the puts of every output route (each task names its route)."""

    def __init__(
        self,
        routes: Sequence[OutputRoute],
        registry: RequestRegistry,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.002,
        handoff_s: float = 0.0,
        name: str = "omni-send",
        cleanup_backlog: CleanupBacklog | None = None,
    ) -> None:
        self._routes = tuple(routes)
        self._registry = registry
        #: keys of aborted requests whose cleanup failed (a backend down), retried at shutdown
        self._backlog = cleanup_backlog if cleanup_backlog is not None else CleanupBacklog()
        self.max_retries = max_retries
        self._backoff = retry_backoff_s
        self._lock = registry.lock  # entered directly: ``with`` on the Condition adds a Python frame per hold
        self._cond = threading.Condition(registry.lock)  # only ``wait_idle`` waits on it
        self._idle_waiters = 0  # ``wait_idle`` callers (lock held to read/write): completions notify only then
        self._work = WakeFlag()  # set (lock held) to wake the idle send thread; cleared by it (lock held)
        self._handoff_s = handoff_s
        self._handoff: SendTask | None = None  # the task a ``hand_over`` waits for (lock held to read/write)
        self._handoff_signal: Any = None  # that wait's lock: held by the waiter's side, released once the task was taken
        self.put_mean_s = 0.0  # running mean of put durations (written by the send thread only)
        self._ring: deque[RequestState] = deque()
        self._stop = False
        self._idle = False  # the send thread waits for work (lock held to read/write): enqueue wakes it only then
        #: ``rounds``: lock rounds that took tasks; ``sleeps``: waits for work (each ends in a thread wake-up);
        #: ``handoffs``: ``send_chunk`` calls that waited for their task to be taken, ``handoff_timeouts`` of them in vain
        #: ``put_many``: calls that stored one payload under several keys (each of their keys also counts in ``puts``
        #: or ``put_failures``)
        self.stats = {
            "puts": 0, "put_failures": 0, "put_many": 0, "dropped": 0, "rounds": 0, "sleeps": 0, "handoffs": 0, "handoff_timeouts": 0
        }  # fmt: skip
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- model thread ---------------------------------------------------------
    def enqueue_locked(self, state: RequestState, route: OutputRoute, key: str, data: Any, *, hand_over: bool = False) -> Any:
        """Queue ``data`` under ``key`` on ``route`` for ``state``'s request; the caller holds the registry lock.

        ``hand_over``: also claim the hand-over slot for this task when a
        hand-over is due (see :meth:`hand_over`); returns the signal to pass
        to :meth:`hand_over`, or None (no wait).
        """
        task = SendTask(key, data, route)
        if route.observer is not NO_OBSERVER:
            task.queued = time.monotonic()
        state.send_queue.append(task)
        state.in_flight += 1
        if not state.in_send_ring:
            state.in_send_ring = True
            self._ring.append(state)
        if self._idle:  # busy: it takes this task in its next round without a wake-up
            self._idle = False
            self._work.set()  # one lock release (a Condition's notify walks its waiter list in Python)
        if not hand_over or self._handoff is not None or self._handoff_s <= 0 or self.put_mean_s > self._handoff_s or self._stop:
            return None
        signal = _allocate_lock()
        signal.acquire()  # released by the send thread once it took ``task``
        self._handoff, self._handoff_signal = task, signal
        self.stats["handoffs"] += 1
        return signal

    def hand_over(self, signal: Any) -> None:
        """Model thread, no lock held: wait up to ``handoff_s`` until the send thread has taken the task
        whose :meth:`enqueue_locked` returned ``signal`` (None: no wait).

        Waiting lets go of the GIL, so the send thread starts the put now
        rather than after the caller's step. Not claimed while puts take
        longer than ``handoff_s`` on average (then the caller would mostly
        wait for other puts, which is what the send thread is there to spare
        it) and while another thread waits for its own hand-over (one slot).
        The signal is a fresh lock, held until the send thread releases it:
        one futex wait and one wake, and no lock round after a wait that
        ended in time (the send thread freed the slot when it released it).
        """
        if signal is None or signal.acquire(True, self._handoff_s):
            return
        with self._lock:
            if self._handoff_signal is signal:  # still ours: not taken in time
                self.stats["handoff_timeouts"] += 1
                self._handoff = self._handoff_signal = None

    def _signal_handoff_locked(self) -> None:
        """Send thread (or stop), lock held: wake the ``hand_over`` waiting for a task that was taken (once)."""
        task = self._handoff
        if task is not None and (task.taken or self._stop):
            self._handoff_signal.release()
            self._handoff = self._handoff_signal = None

    def keys_put(self, state: RequestState) -> list[tuple[Connector, str]]:
        """Every key this stage has put (or is putting) for ``state``, with its route's connector."""
        return [(r.connector, r.key(state.external_id, i)) for r in self._routes for i in range(state.sent[r.index])]

    def abort(self, state: RequestState) -> int:
        """Lock held: drop the request's queued puts; returns the puts still running (0 or 1)."""
        state.in_flight -= len(state.send_queue)
        state.send_queue.clear()
        return state.in_flight

    def purge(self, keys: list[tuple[Connector, str]]) -> None:
        """Free keys of an aborted request (those already consumed are simply absent); one whose cleanup
        fails (the backend unreachable) is kept for the retry at shutdown."""
        for connector, key in keys:
            if connector.closed:
                continue
            try:
                connector.cleanup(key)
            except Exception:
                logger.debug("cleanup of %s failed; kept for a retry at shutdown", key, exc_info=True)
                self._backlog.keep(connector, key)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no task is queued or in flight (tests, orderly shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._idle_waiters += 1
            try:
                while any(s.in_flight for s in self._registry) or self._ring:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, 0.01))
            finally:
                self._idle_waiters -= 1
        return True

    def cpu_seconds(self) -> float | None:
        """CPU time the send thread has used so far (None once it ended, or where the OS cannot tell)."""
        return thread_cpu_seconds(self._thread)

    def stop(self, timeout: float) -> None:
        with self._lock:
            self._stop = True
            self._work.set()
            self._cond.notify_all()
            self._signal_handoff_locked()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("send thread did not stop within %.1fs", timeout)

    # -- send thread ---------------------------------------------------------
    def _next_tasks(self) -> list[tuple[RequestState, SendTask]]:
        """Under the lock: the next due task of each request in the ring (round-robin, at most ``_BATCH``).

        At most one task per request and route, so a failed put is re-queued
        before the next task of its request on that route is taken; the tasks
        of one chunk to several destinations (fan-out) go in the same round.
        """
        now = time.monotonic()
        ring = self._ring
        picked: list[tuple[RequestState, SendTask]] = []
        for _ in range(len(ring)):
            state = ring[0]
            if not state.send_queue:
                ring.popleft()
                state.in_send_ring = False
                continue
            task = state.send_queue[0]
            if task.not_before > now:
                ring.rotate(-1)
                continue
            state.send_queue.popleft()
            picked.append((state, task))
            queue = state.send_queue
            if queue and queue[0].route is not task.route:  # fan-out: the same chunk's other destinations
                routes = {task.route}
                while queue and queue[0].route not in routes and queue[0].not_before <= now and len(picked) < _BATCH:
                    routes.add(queue[0].route)
                    picked.append((state, queue.popleft()))
            ring.popleft()
            if state.send_queue:
                ring.append(state)
            else:
                state.in_send_ring = False
            if len(picked) >= _BATCH:
                break
        return picked

    def _run(self) -> None:
        """Per lock round: book the previous round's puts, take the next due tasks (or sleep), put them.

        Booking and taking share one hold: a round costs one lock round trip, not two.
        """
        lock = self._lock
        picked: list[tuple[RequestState, SendTask]] = []
        results: list[bool] = []
        while True:
            purge: list[tuple[Connector, str]] = []
            with lock:
                if picked:
                    for (state, task), ok in zip(picked, results, strict=True):
                        purge += self._done(state) if ok or state.purge_sent else self._retry_or_drop(state, task)
                    if self._idle_waiters:
                        self._cond.notify_all()
                # keys to free go first (outside the lock), then the next tasks are taken
                picked = [] if purge else self._take_locked()
            if purge:
                self.purge(purge)
                continue
            if not picked:
                return  # stopped
            self.stats["rounds"] += 1
            results = self._put_round(picked)

    def _take_locked(self) -> list[tuple[RequestState, SendTask]]:
        """Lock held: the next due tasks, marked taken (sleeping until there are some); [] once stopped."""
        picked: list[tuple[RequestState, SendTask]] = []
        while not self._stop:
            picked = self._next_tasks()
            if picked:
                for _, task in picked:
                    task.taken = True
                if self._handoff is not None:
                    self._signal_handoff_locked()
                return picked
            self._sleep_locked()
        return []

    def _sleep_locked(self) -> None:
        """Lock held: wait for work (an enqueue sets ``_work``), a due retry or stop; the lock is let go meanwhile."""
        self.stats["sleeps"] += 1
        self._idle = True
        lock, work = self._lock, self._work
        lock.release()  # held exactly once here: ``_run`` is the only holder on this thread
        try:
            work.wait(self._backoff if self._ring else 0.1)
        finally:
            lock.acquire()
        self._idle = False
        work.clear()

    def _put_round(self, picked: list[tuple[RequestState, SendTask]]) -> list[bool]:
        """Put a round's tasks: one ``put`` each, except the tasks of one payload (a fan-out, taken together
        by :meth:`_next_tasks`) whose routes share a connector: one ``put_many`` per connector. Results in
        ``picked``'s order."""
        if len(picked) == 1:
            return [self._put(*picked[0])]
        results = [False] * len(picked)
        i, n = 0, len(picked)
        while i < n:
            state, task = picked[i]
            j = i + 1
            while j < n and picked[j][0] is state and picked[j][1].data is task.data:
                j += 1
            if j == i + 1:
                results[i] = self._put(state, task)
            else:
                by_connector: dict[int, list[int]] = {}
                for k in range(i, j):
                    by_connector.setdefault(id(picked[k][1].route.connector), []).append(k)
                for ks in by_connector.values():
                    oks = self._put_many([picked[k][1] for k in ks]) if len(ks) > 1 else [self._put(state, picked[ks[0]][1])]
                    for k, ok in zip(ks, oks, strict=True):
                        results[k] = ok
            i = j
        return results

    def _put_many(self, tasks: list[SendTask]) -> list[bool]:
        """One payload under the keys of several tasks whose routes share a connector: one ``put_many``, a result per task."""
        started = time.monotonic()
        try:
            results = tasks[0].route.connector.put_many([(*t.route.edge, t.key) for t in tasks], tasks[0].data)
        except Exception as exc:  # none of them stored: each is retried
            keys = ", ".join(t.key for t in tasks)
            logger.warning("put of %s raised %s: %s", keys, type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.INFO))
            results = None
        oks = [False] * len(tasks) if results is None else [_settled(task, result) for task, result in zip(tasks, results, strict=True)]
        self.put_mean_s += _PUT_EWMA_WEIGHT * (time.monotonic() - started - self.put_mean_s)
        stored = sum(oks)
        self.stats["puts"] += stored
        self.stats["put_failures"] += len(oks) - stored
        self.stats["put_many"] += 1
        return oks

    def _put(self, state: RequestState, task: SendTask) -> bool:
        started = time.monotonic()
        try:
            route = task.route
            ok = _settled(task, route.connector.put(*route.edge, task.key, task.data))
        except Exception as exc:  # retried: one line each, the traceback with -v (INFO)
            logger.warning("put of %s raised %s: %s", task.key, type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.INFO))
            ok = False
        self.put_mean_s += _PUT_EWMA_WEIGHT * (time.monotonic() - started - self.put_mean_s)
        self.stats["puts" if ok else "put_failures"] += 1
        return ok

    def _done(self, state: RequestState) -> list[tuple[Connector, str]]:
        """One put finished; free a released request after its last. Returns keys to purge (aborted)."""
        state.in_flight -= 1
        if state.in_flight == 0 and state.released:
            self._registry.drop(state)
            if state.purge_sent:
                return self.keys_put(state)
        return []

    def _retry_or_drop(self, state: RequestState, task: SendTask) -> list[tuple[Connector, str]]:
        task.attempts += 1
        if task.attempts <= self.max_retries and not self._stop:
            task.not_before = time.monotonic() + self._backoff * (2 ** (task.attempts - 1))
            state.send_queue.appendleft(task)
            if not state.in_send_ring:
                state.in_send_ring = True
                self._ring.appendleft(state)
            logger.warning("re-queued %s (retry %d/%d)", task.key, task.attempts, self.max_retries)
            return []
        logger.error("giving up on %s after %d retries; request %s reported failed", task.key, self.max_retries, state.request_id)
        task.route.observer.failed("put", finished=False)
        self.stats["dropped"] += 1
        self._registry.outbox.failed.add(state.request_id)
        return self._done(state)


def _settled(task: SendTask, result: PutResult) -> bool:
    """Whether the put of ``task`` stored its payload: the route's observer hears of a stored one, a refused one is logged."""
    if not result.ok:
        logger.warning("put of %s failed: %s", task.key, (result.metadata or {}).get("error", "backend refused"))
        return False
    observer = task.route.observer
    if observer is not NO_OBSERVER:
        observer.delivered(result.size, time.monotonic() - task.queued, finished=False)
    return True
