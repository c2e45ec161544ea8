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
