"""Child processes for multi-process tests: fresh interpreters that do not each import torch again.

``multiprocessing``'s ``spawn`` start method runs a new interpreter per child,
which then imports torch and the plugins: ~2-4 s of CPU per child on a small
machine, most of a multi-process test's time. :func:`process_context` returns
the ``forkserver`` context instead, with torch, the core and the installed
plugins' ``preload`` modules (their services) preloaded: the server process imports them once (the first child of a
test session pays for it) and forks every child from that clean state. Each
child is still its own process, with nothing inherited from the test process
(no threads, no connectors, no test state), and targets and arguments are
pickled exactly as with ``spawn``.

Caveat: a forkserver child inherits the environment of the moment the server
started (the first child's), not the test process's current one; a test that
changes ``os.environ`` for a child should start it with ``spawn``.
"""

from __future__ import annotations

from multiprocessing.context import ForkServerContext, SpawnContext

from omni_plugins.forkserver import preloaded_context

#: the core's modules imported once in the fork server, before every installed plugin's ``preload`` (missing ones are skipped)
PRELOAD = ["torch", "omni_plugins", "omni_plugins.wire", "omni_plugins.runtime", "omni_plugins.kv.testing"]


def process_context() -> ForkServerContext | SpawnContext:
    """:func:`omni_plugins.forkserver.preloaded_context` with :data:`PRELOAD` and every installed plugin's preload modules."""
    from omni_plugins.services import preload_modules

    return preloaded_context([*PRELOAD, *preload_modules()])
