"""A job's live progress for people: pages done / queued / failed, rate and ETA.

:class:`ProgressMeter` is the arithmetic (no I/O, no clock): it turns successive
observations of a job's ledger counters into a pages/s rate over a sliding window and,
when one can be estimated, an ETA. :class:`JobProgress` shows it: a rich progress bar when
the console is a terminal, one plain line every ``interval_s`` otherwise (logs, CI, pipes).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from shared.contracts import JobCounters


@dataclass(frozen=True)
class Snapshot:
    """One observation of a job: ``at_s`` monotonic seconds; counts in pages.

    ``done`` is every finished page (failed ones included); ``queued`` is admitted but not
    yet finished (the frontier and the pages in flight).
    """

    at_s: float
    admitted: int
    done: int
    failed: int

    @property
    def queued(self) -> int:
        return max(self.admitted - self.done, 0)


@dataclass(frozen=True)
class Estimate:
    """What the display shows. ``rate`` in pages/s and ``eta_s`` in seconds, None when
    unknown (fewer than ``min_span_s`` seconds observed; no page budget reached and a
    frontier that is not shrinking)."""

    done: int
    queued: int
    failed: int
    admitted: int
    rate: float | None
    eta_s: float | None


class ProgressMeter:
    """Rate over a sliding window and an ETA, from successive counter observations.

    The ETA is estimated two ways, the first that applies:

    - **page budget reached**: once ``admitted >= budget`` (the job's ``max_pages``) nothing
      more is admitted, so the remaining work is the queue: ``queued / rate``;
    - **shrinking frontier**: when ``queued`` fell over the window, extrapolate its net
      decrease: ``queued / (-d queued / dt)``.

    Otherwise (the frontier is growing) there is no honest estimate and ``eta_s`` is None.

    Args:
        budget: the job's page budget (``CrawlRequest.max_pages``), None when unknown.
        window_s: width of the sliding window the rate is measured over, seconds.
        min_span_s: the shortest span of observations a rate is computed from, seconds.
    """

    def __init__(self, budget: int | None = None, window_s: float = 10.0,
                 min_span_s: float = 1.0) -> None:
        self.budget = budget
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._samples: deque[Snapshot] = deque()

    def observe(self, at_s: float, counters: JobCounters) -> Estimate:
        """Record the counters seen at ``at_s`` (monotonic seconds) and estimate."""
        now = Snapshot(at_s, counters.admitted, counters.finished, counters.failed)
        if self._samples and at_s < self._samples[-1].at_s:
            self._samples.clear()  # a clock that went back: start over
        self._samples.append(now)
        while len(self._samples) > 2 and at_s - self._samples[1].at_s >= self.window_s:
            self._samples.popleft()  # keep one sample at or beyond the window's start
        first = self._samples[0]
        span_s = at_s - first.at_s
        rate = eta_s = None
        if span_s >= self.min_span_s:
            rate = max(now.done - first.done, 0) / span_s
            eta_s = self._eta(first, now, span_s, rate)
        return Estimate(now.done, now.queued, now.failed, now.admitted, rate, eta_s)

    def _eta(self, first: Snapshot, now: Snapshot, span_s: float, rate: float) -> float | None:
        if now.queued == 0:
            return None
        if self.budget is not None and now.admitted >= self.budget:
            return now.queued / rate if rate > 0 else None
        drain = (first.queued - now.queued) / span_s
        return now.queued / drain if drain > 0 else None


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``2h05m``: a duration for people, rounded up to the second."""
    total = int(-(-seconds // 1))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def progress_parts(estimate: Estimate) -> list[str]:
    """``["120 done", "40 queued", "0 failed", "35.2 pages/s", "ETA 1s"]``: the parts known."""
    parts = [f"{estimate.done} done", f"{estimate.queued} queued", f"{estimate.failed} failed"]
    if estimate.rate is not None:
        parts.append(f"{estimate.rate:.1f} pages/s")
    if estimate.eta_s is not None:
        parts.append(f"ETA {format_duration(estimate.eta_s)}")
    return parts


def describe(job: str, estimate: Estimate) -> str:
    """``job X: 120 done, 40 queued, 0 failed, 35.2 pages/s, ETA 1s`` (the parts known)."""
    return f"job {job}: " + ", ".join(progress_parts(estimate))


class DisplayMode(StrEnum):
    RICH = "rich"    # a live progress bar (a terminal)
    LINES = "lines"  # one plain line per update interval (not a terminal)
    OFF = "off"


class JobProgress:
    """Shows a job's progress on ``console`` while used as a context manager.

    Args:
        job: the job id, shown on every line.
        console: where to draw (the CLI's stderr console).
        mode: RICH, LINES or OFF; :meth:`for_console` picks RICH or LINES.
        budget: the job's page budget (``max_pages``), for the ETA.
        interval_s: in LINES mode, the least time between two lines, seconds.
    """

    def __init__(self, job: str, console: Console, mode: DisplayMode,
                 budget: int | None = None, interval_s: float = 2.0) -> None:
        self.job = job
        self.console = console
        self.mode = mode
        self.meter = ProgressMeter(budget)
        self.interval_s = interval_s
        self._printed_at: float | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    @classmethod
    def for_console(cls, job: str, console: Console, show: bool,
                    budget: int | None = None) -> JobProgress:
        """RICH on a terminal, LINES otherwise, OFF when not ``show``."""
        mode = DisplayMode.OFF if not show else (
            DisplayMode.RICH if console.is_terminal else DisplayMode.LINES)
        return cls(job, console, mode, budget)

    def __enter__(self) -> JobProgress:
        if self.mode is DisplayMode.RICH:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task(f"job {self.job}", total=None, detail="")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, counters: JobCounters, final: bool = False,
               at_s: float | None = None) -> Estimate:
        """Show ``counters`` as seen at ``at_s`` (default now); ``final`` always prints."""
        at_s = time.monotonic() if at_s is None else at_s
        estimate = self.meter.observe(at_s, counters)
        if self._progress is not None and self._task is not None:
            detail = ", ".join(progress_parts(estimate)[1:])  # the bar shows done/admitted
            self._progress.update(self._task, total=max(estimate.admitted, 1),
                                  completed=estimate.done, detail=detail)
        elif self.mode is DisplayMode.LINES and (
            final or self._printed_at is None or at_s - self._printed_at >= self.interval_s
        ):
            self._printed_at = at_s
            self.console.print(describe(self.job, estimate), markup=False, highlight=False,
                               soft_wrap=True)
        return estimate
