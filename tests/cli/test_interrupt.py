"""Ctrl-C (SIGINT to the whole process group, as a terminal sends it) stops a run cleanly: exit 130, nothing left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .conftest import tiny_pipeline


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a shell running the test in the background may have it ignored


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("presses", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_ctrl_c_stops_every_stage_and_leaves_no_shared_memory(presses: int, tmp_path: Path, shm_ns: str) -> None:
    from omni_plugins_shm.testing import namespace_segments

    path = tiny_pipeline(tmp_path, extra=f"{{namespace: {shm_ns}}}", steps=100000)  # runs until interrupted
    cmd = [sys.executable, "-m", "omni_plugins", "run", str(path), "-n", "2", "--no-progress"]
    proc = subprocess.Popen(
        cmd, start_new_session=True, preexec_fn=_default_sigint, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not namespace_segments(shm_ns):  # payloads are moving: the stages have their connectors open
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never started moving payloads"
            time.sleep(0.1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 2
        for i in range(presses):
            if i:
                time.sleep(0.05)  # lands while the stages stop or while the process exits: both must end the same
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err and "Traceback" not in err, err[-3000:]
    _, alive = psutil.wait_procs(tree, timeout=30)  # the fork server ends when it sees its parent gone
    running = [p for p in alive if _running(p)]  # an orphaned zombie waits for init, it runs nothing
    assert running == [], f"processes of the run still alive: {running}"
    assert namespace_segments(shm_ns) == []


@pytest.fixture
def default_sigint():  # type: ignore[no-untyped-def]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_sigint")
def test_the_first_ctrl_c_interrupts_and_later_ones_are_ignored() -> None:
    from omni_plugins.cli.interrupts import first_interrupt_only

    with pytest.raises(KeyboardInterrupt), first_interrupt_only():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # never reached: the handler raises at once
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)  # ignored: the command is exiting


@pytest.mark.usefixtures("default_sigint")
def test_an_error_caused_by_the_interrupt_is_reported_as_the_interrupt() -> None:
    from omni_plugins.cli.interrupts import first_interrupt_only

    with pytest.raises(KeyboardInterrupt), first_interrupt_only():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise ImportError("cannot load module more than once per process") from None  # what an interrupted 'import torch' does


@pytest.mark.usefixtures("default_sigint")
def test_without_an_interrupt_the_default_handler_is_back() -> None:
    from omni_plugins.cli.interrupts import first_interrupt_only

    with pytest.raises(ValueError), first_interrupt_only():
        raise ValueError("an ordinary error stays what it is")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
