"""The soak's code path (``benchmarks/soak.py``) with a few hundred requests: zero leaks, every stream intact.

RSS growth is reported by the benchmark but not asserted here (too noisy for a
short run on a shared machine).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from rel_pipeline import track

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("omni_soak_bench", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


@pytest.mark.parametrize("backend", ["shm", "redis", "mooncake-store"])
def test_bounded_soak_leaves_nothing(backend: str, request: pytest.FixtureRequest) -> None:
    if backend == "mooncake-store":
        pytest.importorskip("mooncake.store")
    b = soak.make_backend(backend, server=request.getfixturevalue("redis_server")) if backend == "redis" else soak.make_backend(backend)
    result = soak.run_soak(b, requests=150, abort_fraction=0.1, chunks=4, window=50, window_timeout=60.0)
    if backend == "mooncake-store":
        for pid in b.master.launched_pids:  # the session checks that the soak's own master is gone
            track(pid)
    assert result.bad == {}
    assert (result.finished, result.aborted) == (135, 15)
    assert result.consumer_active == 0, "per-request state left in the consumer runtime"
    assert result.producer_active == 0, "per-request state left in the producer runtime"
    assert result.leftovers_open == [], f"payloads left in the backend while open: {result.leftovers_open[:5]}"
    assert result.leftovers_closed == [], f"left after close: {result.leftovers_closed[:5]}"


def test_rss_growth_tells_a_warm_up_from_a_leak() -> None:
    """``growth_second_half`` stays flat after a warm-up and keeps rising with a leak; ``growth`` rises for both."""
    mib = 2**20
    warm_up = [(n, (300 + min(n, 2500) * 0.01) * mib, 300 * mib) for n in range(50, 10_001, 50)]  # +25 MiB, then flat
    leak = [(n, (300 + n * 0.003) * mib, 300 * mib) for n in range(50, 10_001, 50)]  # +3 MiB per thousand requests
    w = soak.rss_summary(warm_up, 10_000)["consumer"]
    k = soak.rss_summary(leak, 10_000)["consumer"]
    assert w["growth"] > 0.05 and k["growth"] > 0.05
    assert w["growth_second_half"] == 0.0
    assert k["growth_second_half"] > 0.02
