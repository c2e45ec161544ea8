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


def test_polls_that_lose_their_core_pause_polling_and_probes_resume_it() -> None:
    """Busy cores (the poller keeps being preempted): windows withheld but for a probe every 8 intervals; free cores bring them back."""
    r = rhythm()
    bursts(r, [0.0, 0.020, 0.040, 0.060])
    k = 4

    def step(preempted: bool) -> bool:
        """Step ``k``: ask for a window shortly before its burst is due (as the receiver does), poll if given one, then the burst."""
        nonlocal k
        due = 0.020 * k
        window = r.window(due - 0.002)
        if window is not None:
            r.polled(preempted, due)
        bursts(r, [due])
        k += 1
        return window is not None

    assert step(False)
    assert step(True) and step(True)  # one or two preempted polls among free ones: still polling
    assert not r.contended
    assert step(True)
    assert r.contended
    assert [step(True) for _ in range(16)] == [False] * 8 + [True] + [False] * 7  # one probe
    resumed = [step(False) for _ in range(40)]  # probes find the cores free again
    assert resumed[:3] == [False, True, False]  # the next probe (9 intervals after the last), still withheld after it
    assert resumed[-10:] == [True] * 10
    assert not r.contended


def test_preemption_counter_counts_this_threads_preemptions() -> None:
    """The receiver's source of ``polled(preempted=...)``: non-decreasing, per thread (Linux)."""
    from omni_plugins.runtime.threads import preemptions

    if preemptions is None:
        pytest.skip("no per-thread rusage on this OS")
    a = preemptions()
    assert isinstance(a, int) and a >= 0
    assert preemptions() >= a
