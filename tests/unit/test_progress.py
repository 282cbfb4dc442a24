"""The progress arithmetic (rate over a sliding window, ETA) and its two displays."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from shared.cli.progress import (
    DisplayMode,
    Estimate,
    JobProgress,
    ProgressMeter,
    describe,
    format_duration,
)
from shared.contracts import JobCounters


def counters(admitted: int, finished: int, failed: int = 0) -> JobCounters:
    return JobCounters(admitted=admitted, finished=finished, failed=failed, seeded=True)


def test_no_rate_until_enough_time_was_observed() -> None:
    meter = ProgressMeter(window_s=10, min_span_s=1)
    assert meter.observe(0.0, counters(5, 0)).rate is None
    assert meter.observe(0.5, counters(5, 2)).rate is None
    estimate = meter.observe(1.0, counters(5, 4))
    assert estimate.rate == pytest.approx(4.0)
    assert (estimate.done, estimate.queued, estimate.failed) == (4, 1, 0)


def test_the_rate_covers_only_the_sliding_window() -> None:
    meter = ProgressMeter(window_s=10)
    for second in range(11):  # 1 page/s for 10 s
        meter.observe(float(second), counters(1000, second))
    for second in range(11, 21):  # then 5 pages/s
        estimate = meter.observe(float(second), counters(1000, 10 + 5 * (second - 10)))
    assert estimate.rate == pytest.approx(5.0)


def test_the_eta_once_the_page_budget_is_reached_is_the_queue_over_the_rate() -> None:
    meter = ProgressMeter(budget=100)
    meter.observe(0.0, counters(100, 40))
    estimate = meter.observe(2.0, counters(100, 60))  # 10 pages/s, 40 queued
    assert estimate.eta_s == pytest.approx(4.0)


def test_the_eta_of_a_shrinking_frontier_extrapolates_its_net_decrease() -> None:
    meter = ProgressMeter(budget=10_000)
    meter.observe(0.0, counters(100, 50))  # 50 queued
    estimate = meter.observe(2.0, counters(110, 70))  # 40 queued: -5 pages/s net
    assert estimate.rate == pytest.approx(10.0)
    assert estimate.eta_s == pytest.approx(8.0)


@pytest.mark.parametrize(("budget", "later"), [
    (10_000, counters(200, 60)),  # the frontier grows, the budget is far
    (None, counters(200, 60)),  # no budget known
    (100, counters(100, 40)),  # budget reached but nothing finished: no rate to divide by
    (100, counters(100, 100)),  # nothing queued
])
def test_no_eta_when_none_can_be_estimated(budget: int | None, later: JobCounters) -> None:
    meter = ProgressMeter(budget=budget)
    meter.observe(0.0, counters(min(later.admitted, 100), 40))
    assert meter.observe(5.0, later).eta_s is None


def test_a_clock_going_back_starts_the_window_over() -> None:
    meter = ProgressMeter()
    meter.observe(10.0, counters(10, 5))
    assert meter.observe(3.0, counters(10, 6)).rate is None


@pytest.mark.parametrize(("seconds", "shown"), [
    (0, "0s"), (0.2, "1s"), (59, "59s"), (60, "1m00s"), (187, "3m07s"), (7500, "2h05m"),
])
def test_durations_are_shown_for_people(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_a_line_names_the_job_and_the_parts_known() -> None:
    full = Estimate(done=120, queued=40, failed=0, admitted=160, rate=35.2, eta_s=1.0)
    assert describe("X", full) == "job X: 120 done, 40 queued, 0 failed, 35.2 pages/s, ETA 1s"
    early = Estimate(done=0, queued=1, failed=0, admitted=1, rate=None, eta_s=None)
    assert describe("X", early) == "job X: 0 done, 1 queued, 0 failed"


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=200), out


def test_off_a_terminal_one_line_is_printed_per_interval_and_the_final_state_always() -> None:
    shown, out = console(terminal=False)
    progress = JobProgress.for_console("J", shown, show=True, budget=None)
    assert progress.mode is DisplayMode.LINES
    with progress:
        for tenth in range(0, 45, 5):  # every 0.5 s for 4 s
            progress.update(counters(10, tenth // 5), at_s=tenth / 10)
        progress.update(counters(10, 10), final=True, at_s=5.0)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "job J: 0 done", "job J: 4 done", "job J: 8 done", "job J: 10 done"]
    assert lines[-1] == "job J: 10 done, 0 queued, 0 failed, 2.0 pages/s"


def test_on_a_terminal_a_bar_shows_counts_rate_and_eta() -> None:
    shown, out = console(terminal=True)
    with JobProgress.for_console("J", shown, show=True, budget=20) as progress:
        assert progress.mode is DisplayMode.RICH
        progress.update(counters(20, 0), at_s=0.0)
        progress.update(counters(20, 10, failed=1), at_s=2.0)
    screen = out.getvalue()
    assert "10/20" in screen
    assert "10 queued, 1 failed, 5.0 pages/s, ETA 2s" in screen


def test_nothing_is_shown_when_not_asked() -> None:
    shown, out = console(terminal=True)
    with JobProgress.for_console("J", shown, show=False) as progress:
        progress.update(counters(1, 1), final=True)
    assert out.getvalue() == ""
