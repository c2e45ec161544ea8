"""How child processes start: a fork server with the heavy imports done once.

``spawn`` runs a new interpreter per child, which then imports torch (seconds
each on a small machine, and all of a pipeline's stages start at once). A fork
of a server that imported it once starts in milliseconds, and the server is a
clean process (no threads, no CUDA context, no connectors), so forking it is
safe. ``omni-plugins run`` starts its stages this way, and the multi-process
tests their children (:mod:`omni_plugins.testing.processes`).
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, SpawnContext


def preloaded_context(preload: Sequence[str]) -> ForkServerContext | SpawnContext:
    """The ``forkserver`` context importing ``preload`` in its server (missing modules are skipped).

    The list takes effect when the server starts (the process's first child); later calls
    change nothing. ``spawn`` where there is no fork server (macOS builds without it, Windows).
    """
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - Linux has it
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def start_shielded(ctx: ForkServerContext | SpawnContext) -> None:
    """Start ``ctx``'s fork server now, with SIGINT blocked while it is launched.

    Ctrl-C reaches the whole process group. The server ignores SIGINT only once its
    preload (seconds: torch) is done, so one arriving earlier would kill it and every
    later child start would fail (``EOFError``). Launched with SIGINT blocked, the
    server and the children it forks keep it blocked; the caller's pending SIGINT is
    delivered when its mask is restored, so no Ctrl-C is lost. (The stdlib launches
    its resource tracker the same way.) Nothing to do for ``spawn`` or a running server.
    """
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
