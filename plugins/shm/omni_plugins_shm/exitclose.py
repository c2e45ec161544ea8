"""Close the connectors a process still has open when its interpreter exits, before module teardown.

A connector left open is otherwise closed from some ``__del__`` (vLLM-Omni's connectors close
from theirs) while the interpreter tears its modules down. By then the globals of this plugin's
modules may already be ``None``: such a close failed half-way and left the namespace's publish
directory, with its slot table, in /dev/shm. ``atexit`` handlers run before that teardown, with
every module intact, so a close from here frees everything; the later ``__del__`` finds the
connector closed and does nothing. A process that never gets to ``atexit`` (killed, ``os._exit``)
leaves files of a dead owner, which ``omni-plugins shm gc`` and the next instance's
``reclaim_on_start`` free.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class _Closeable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[_Closeable] = weakref.WeakSet()
_lock = threading.Lock()


def close_at_exit(connector: _Closeable) -> None:
    """Close ``connector`` at interpreter exit if it is still alive then (held weakly: no leak, no resurrection)."""
    with _lock:
        _open.add(connector)


def _close_open() -> None:
    with _lock:
        connectors = list(_open)
        _open.clear()
    for connector in connectors:
        try:
            connector.close()
        except Exception:
            log.warning("closing an shm connector at interpreter exit failed", exc_info=True)


atexit.register(_close_open)
