"""``debug_state`` reports the CPU time of the I/O threads (benchmarks split per-chunk cost with it)."""

from __future__ import annotations

import threading

from rt_helpers import Req, make_runtime

from omni_plugins.runtime.threads import thread_cpu_seconds

STREAM = {"async_chunk": True, "custom_process_next_stage_input_func": "rt_builders.stream"}


def test_io_thread_cpu_is_reported_while_running(runtimes: list, namespace: str) -> None:
    p = make_runtime(0, namespace, **STREAM)
    c = make_runtime(1, namespace, async_chunk=True)
    runtimes += [p, c]
    for i in range(3):
        p.send_chunk(Req("r"), {"ids": {"prompt": [i]}})
    assert p.wait_sends()
    sender = p.debug_state()["sender"]
    receiver = c.debug_state()["receiver"]
    assert sender["puts"] == 3
    assert isinstance(sender["cpu_s"], float) and sender["cpu_s"] > 0
    assert isinstance(receiver["cpu_s"], float) and receiver["cpu_s"] > 0
    p.cleanup_finished_request("r", aborted=True)  # nobody reads them: free the three chunks
    p.shutdown()
    assert p.debug_state()["sender"]["cpu_s"] is None  # the thread is gone


def test_thread_cpu_of_a_thread_that_never_ran_or_ended() -> None:
    t = threading.Thread(target=lambda: None)
    assert thread_cpu_seconds(t) is None
    t.start()
    t.join()
    assert thread_cpu_seconds(t) is None
