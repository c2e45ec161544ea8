"""The shared helpers: one free-port helper, one backoff."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from omni_plugins.backoff import Backoff, poll
from omni_plugins.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_free_port_is_bindable_and_the_pair_too() -> None:
    port = free_port(also_plus=10000)
    for p in (port, port + 10000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_no_other_free_port_helper_in_the_packages() -> None:
    """Every package binds port 0 only in omni_plugins.ports (tests excepted: they open listeners of their own)."""
    copies = [
        str(path.relative_to(ROOT))
        for base in (ROOT / "omni_plugins", *ROOT.glob("plugins/*/omni_plugins_*"))
        for path in base.rglob("*.py")
        if "getsockname()[1]" in path.read_text(encoding="utf-8") and path.name != "ports.py"
    ]
    assert copies == []


def test_backoff_doubles_up_to_its_bound_and_stops_at_the_deadline() -> None:
    pauses: list[float] = []
    backoff = Backoff(0.01, 0.04)
    for _ in range(4):
        assert backoff.sleep(pauses.append)
    assert pauses == [0.01, 0.02, 0.04, 0.04]
    backoff.reset()
    assert backoff.sleep(pauses.append) and pauses[-1] == 0.01
    expired = Backoff(0.01, 0.04, deadline=time.monotonic() - 1)
    assert not expired.sleep(pauses.append) and len(pauses) == 5
    with pytest.raises(ValueError, match="first <= maximum"):
        Backoff(1.0, 0.5)


def test_a_zero_first_pause_retries_at_once() -> None:
    pauses: list[float] = []
    backoff = Backoff(0.0, 1.0)
    assert backoff.sleep(pauses.append) and backoff.sleep(pauses.append)
    assert pauses == []


def test_poll_returns_the_first_answer_or_none_by_the_timeout() -> None:
    answers = iter([None, None, "x"])
    assert poll(lambda: next(answers), timeout=5.0, first=0.001) == "x"
    calls = []
    assert poll(lambda: calls.append(1), timeout=None, first=0.001) is None
    assert calls == [1]  # no timeout: one try
    assert poll(lambda: None, timeout=0.02, first=0.001) is None
