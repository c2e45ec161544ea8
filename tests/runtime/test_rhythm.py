"""``ArrivalRhythm``: when the receive thread polls for the next burst (deterministic clock)."""

from __future__ import annotations

import pytest

from omni_plugins.runtime import RuntimeTuning
from omni_plugins.runtime.rhythm import ArrivalRhythm

LEAD, AFTER = 0.001, 0.0015


def rhythm(**kw: float) -> ArrivalRhythm:
    args = {"lead_s": LEAD, "after_s": AFTER, "burst_gap_s": 0.002, "max_duty": 0.2, **kw}
    return ArrivalRhythm(**args)


def bursts(r: ArrivalRhythm, starts: list[float], size: int = 4, spacing: float = 0.0003) -> float:
    """Feed bursts of ``size`` arrivals ``spacing`` apart; return the last arrival."""
    t = 0.0
    for s in starts:
        for i in range(size):
            t = s + i * spacing
            r.arrived(t)
    return t


def test_no_window_until_three_evenly_spaced_intervals() -> None:
    r = rhythm()
    assert r.window(0.0) is None
    last = bursts(r, [0.0, 0.020, 0.040])  # two intervals: not yet
    assert r.window(last + 0.001) is None
    last = bursts(r, [0.060])
    assert r.window(last + 0.001) == pytest.approx((0.080 - LEAD, 0.080 + AFTER))


def test_arrivals_inside_a_burst_do_not_start_bursts() -> None:
    r = rhythm()
    bursts(r, [0.0, 0.020, 0.040, 0.060], size=8, spacing=0.0015)  # gaps below burst_gap_s
    assert r.interval == pytest.approx(0.020)
    assert r.start == pytest.approx(0.060)


def test_an_uneven_interval_starts_learning_again() -> None:
    r = rhythm()
    last = bursts(r, [0.0, 0.020, 0.040, 0.060])
    assert r.window(last + 0.001) is not None
    last = bursts(r, [0.095])  # 35 ms: not within a quarter of 20 ms
    assert r.window(last + 0.001) is None
    last = bursts(r, [0.130, 0.165, 0.200])  # steady at 35 ms again
    assert r.window(last + 0.001) == pytest.approx((0.235 - LEAD, 0.235 + AFTER))


def test_small_jitter_keeps_the_rhythm_and_moves_the_mean() -> None:
    r = rhythm()
    last = bursts(r, [0.0, 0.020, 0.0405, 0.0605, 0.0815])
    window = r.window(last + 0.001)
    assert window is not None
    assert 0.020 < r.interval < 0.0215  # type: ignore[operator]
    assert window[0] == pytest.approx(0.0815 + r.interval - LEAD)  # type: ignore[operator]


def test_a_late_burst_moves_the_window_one_interval_on() -> None:
    r = rhythm()
    last = bursts(r, [0.0, 0.020, 0.040, 0.060])
    assert last < 0.061
    # 0.080 + AFTER has passed without an arrival: the next window is the one around 0.100
    assert r.window(0.0820) == pytest.approx((0.100 - LEAD, 0.100 + AFTER))
    assert r.window(0.1020) == pytest.approx((0.120 - LEAD, 0.120 + AFTER))


def test_silence_ends_the_polling() -> None:
    r = rhythm()
    last = bursts(r, [0.0, 0.020, 0.040, 0.060])
    assert r.window(last + 0.059) is not None
    assert r.window(last + 0.061) is None  # more than three intervals without an arrival


def test_a_rhythm_too_fast_for_the_duty_cap_is_not_polled() -> None:
    r = rhythm()  # the window (2.5 ms) must be at most 20% of the interval: >= 12.5 ms
    last = bursts(r, [0.0, 0.010, 0.020, 0.030])
    assert r.interval == pytest.approx(0.010)
    assert r.window(last + 0.001) is None
    r2 = rhythm(max_duty=0.5)
    last = bursts(r2, [0.0, 0.010, 0.020, 0.030])
    assert r2.window(last + 0.001) == pytest.approx((0.040 - LEAD, 0.040 + AFTER))


def test_tuning_validates_the_anticipation_knobs() -> None:
    assert RuntimeTuning().anticipate_s > 0
    with pytest.raises(ValueError, match="anticipate"):
        RuntimeTuning(anticipate_s=-1)
    with pytest.raises(ValueError, match="anticipate"):
        RuntimeTuning(anticipate_after_s=-1)
    for duty in (0.0, 1.5):
        with pytest.raises(ValueError, match="anticipate_max_duty"):
            RuntimeTuning(anticipate_max_duty=duty)
