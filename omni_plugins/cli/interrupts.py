"""Ctrl-C for the command line: the first one interrupts, later ones are ignored while the command cleans up.

A terminal sends SIGINT to the whole process group, and users press it twice.
After the first one the process is on its way out; a second one must not cut
its cleanup short (stopping stages and servers) or turn exit status 130 into
"killed by SIGINT". ``omni-plugins run`` shields its own stop phase further
(:class:`omni_plugins.pipeline.launcher.Orchestrator`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT handler: ignore every later SIGINT, then interrupt like Python's default handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextmanager
def first_interrupt_only() -> Iterator[None]:
    """Install :func:`interrupt_once` for the block (only over Python's default handler, in the main thread).

    A block ending normally or with another exception gets the default handler back; after a
    KeyboardInterrupt SIGINT stays ignored (the command is exiting). Any other exception after a Ctrl-C
    becomes a KeyboardInterrupt: it is a consequence (e.g. ``import torch`` interrupted half-way fails
    with an ImportError), not something to report as an error.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, interrupt_once)
    try:
        yield
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise
    except BaseException:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # interrupt_once ran
            raise KeyboardInterrupt from None
        raise
    finally:
        if signal.getsignal(signal.SIGINT) is interrupt_once:
            signal.signal(signal.SIGINT, signal.default_int_handler)
