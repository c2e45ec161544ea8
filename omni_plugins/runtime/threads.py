"""CPU time of the runtime's I/O threads (for ``debug_state`` and benchmarks), and their preemptions.

Per-chunk CPU is the honest cost measure on a shared machine: wall-clock
latency there is mostly queueing behind other processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

try:
    import resource
except ImportError:  # not on this OS
    resource = None  # type: ignore[assignment]


def thread_cpu_seconds(thread: threading.Thread) -> float | None:
    """CPU seconds ``thread`` has used, or None (not running, or no per-thread clock on this OS)."""
    ident = thread.ident
    if ident is None or not thread.is_alive() or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except OSError:  # the thread ended between the check and the call
        return None


def _preemptions_of_this_thread() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


#: times the calling thread was preempted so far (involuntary context switches), or None where the OS
#: cannot tell per thread (``RUSAGE_THREAD`` is Linux's)
preemptions: Callable[[], int] | None = _preemptions_of_this_thread if resource is not None and hasattr(resource, "RUSAGE_THREAD") else None
