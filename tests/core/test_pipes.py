"""The orchestrator's pipes to its stage processes: order kept, a writer never held up, the end of a dead peer seen."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal

import pytest

from omni_plugins.pipeline.pipes import Inbox, Outbox, read_any

CTX = mp.get_context("spawn")


def _echo(inbox: Inbox, out: Outbox) -> None:
    """Send back every message until ``("stop",)``."""
    while True:
        msg = inbox.get(timeout=30)
        out.put(("echo", msg))
        if msg == ("stop",):
            break
    out.close()


def _report_then_hang(out: Outbox) -> None:
    out.put(("ready",))
    out.close()
    signal.pause()


def _pair() -> tuple[Inbox, Outbox]:
    reader, writer = CTX.Pipe(duplex=False)
    return Inbox(reader), Outbox(writer)


def test_messages_cross_processes_in_order_and_a_put_never_waits_for_the_reader() -> None:
    to_child, to_child_out = _pair()
    from_child, from_child_out = _pair()
    proc = CTX.Process(target=_echo, args=(to_child, from_child_out))
    proc.start()
    from_child_out.close()
    to_child.close()
    try:
        messages = [("admit", f"r{i}", {"route": "x" * 100}) for i in range(2000)]  # far more than a pipe's buffer
        for msg in messages:
            to_child_out.put(msg)  # returns while the child is still starting: the feeder thread writes
        to_child_out.put(("stop",))
        got: list[object] = []
        while len(got) < len(messages) + 1:
            got += read_any([from_child], 30)
        assert got == [("echo", m) for m in [*messages, ("stop",)]]
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        to_child_out.close()
        from_child.close()


def test_a_killed_writer_reads_as_the_end_and_a_dead_reader_drops_puts() -> None:
    results, results_out = _pair()
    inbox, inbox_out = _pair()
    proc = CTX.Process(target=_report_then_hang, args=(results_out,))
    proc.start()
    results_out.close()
    inbox.close()  # the child was not given this reader: nobody reads ``inbox_out``
    try:
        assert read_any([results], 30) == [("ready",)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert read_any([results], 5) == []  # the pipe's end, not a hang and not an error
        assert results.ended
        with pytest.raises(queue.Empty):
            results.get(timeout=1)
        inbox_out.put(("abort", "r1"))  # the reader is gone: dropped, no BrokenPipeError
        inbox_out.close()
    finally:
        if proc.is_alive():
            proc.kill()
        results.close()
