"""A set/clear flag another thread can sleep on: :class:`threading.Event` without its condition variable.

The receive thread sets it once per delivery and the model thread clears it
once per collect, both under the registry lock (``Delivery.ready``); the idle
send thread sleeps on one that ``enqueue`` sets (``Sender._work``, instead of a
``Condition`` wait and notify). ``Event.set`` takes the
condition's lock and walks a waiter list in Python (~15 us of CPU per
delivery at the 64-stream bench rhythm, caches cold); here the flag is a
lock that is held while the flag is clear, so ``set`` is one ``release``
(~7 us) and a sleeping waiter wakes on it directly.
"""

from __future__ import annotations

import _thread


class WakeFlag:
    """``set``/``clear``/``is_set``/``wait`` like :class:`threading.Event`.

    ``set`` and ``clear`` must be serialized by the caller (one lock guards
    both); ``wait`` and ``is_set`` may be called from any thread.
    """

    __slots__ = ("_held", "_set")

    def __init__(self) -> None:
        self._held = _thread.allocate_lock()
        self._held.acquire()  # clear: a waiter blocks on the held lock
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._held.release()

    def clear(self) -> None:
        if self._set:
            self._set = False
            self._held.acquire()  # at most a waiter's acquire-release in between: never blocks long

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout`` s passed; True if the flag is set."""
        if self._set:
            return True
        if timeout is None:
            got = self._held.acquire()
        elif timeout > 0:
            got = self._held.acquire(True, timeout)
        else:
            got = self._held.acquire(False)
        if got:
            self._held.release()  # let every other waiter through as well
            return True
        return self._set
