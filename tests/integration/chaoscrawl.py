"""One crawl under faults, and the checks of issue 8 on what the tenant got.

:func:`crawl_under_faults` submits a crawl to a :class:`~tests.integration.chaosmesh.ChaosMesh`
through the CLI's own session (:func:`shared.cli.jobs.open_session`: the MESH and tenant
connections `crawlmesh crawl --wait` uses, progress read from the ledger), runs a fault
script beside the wait, then reads the job's results, events and dead letters.
:meth:`CrawlReport.problems` lists every way the outcome differs from the promise:

- the result URL set equals the expected (reachable) set: nothing lost, nothing extra;
- no URL twice in the tenant's ``RESULTS``;
- exactly one ``completed`` event for the job (and the job completed);
- dead letters only for the messages that genuinely could not be processed (the
  ``poison`` URLs), each with a reason, each with a ``failed`` result.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from shared.cli.jobs import export_results, open_session, read_events, submit, wait_for_job
from shared.contracts import CrawlRequest, JobCounters, JobEvent, JobEventKind
from shared.contracts.results import DeadLetter
from shared.tenancy import DEFAULT_TENANT
from tests.integration.chaosmesh import ChaosMesh, dead_letters

Faults = Callable[[Callable[[], bool]], Awaitable[None]]
"""A fault script: gets ``done()`` (True once the job ended) and returns when finished."""


@dataclass
class CrawlReport:
    """What one crawl produced, read back from the tenant's streams and the DLQ."""

    job: str
    final: JobEvent | None
    """The job's final event; None if it did not end within the timeout."""
    results: list[dict[str, object]]
    completions: int
    letters: list[DeadLetter]
    wall_s: float
    counters: JobCounters = field(default_factory=JobCounters)
    """The job's ledger counts when it was read back (admitted, finished, failed)."""
    urls: collections.Counter[str] = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self.urls = collections.Counter(str(r["url"]) for r in self.results)

    @property
    def duplicates(self) -> int:
        """Results beyond the first of their URL."""
        return sum(count - 1 for count in self.urls.values())

    def lost(self, expected: set[str]) -> set[str]:
        return expected - set(self.urls)

    def letter_urls(self, poison: dict[str, str]) -> dict[str, DeadLetter]:
        """``{poison URL: its dead letter}`` (found by the URL in the original payload)."""
        out: dict[str, DeadLetter] = {}
        for letter in self.letters:
            for url in poison:
                if url.encode() in letter.original:
                    out[url] = letter
        return out

    def problems(self, expected: set[str], poison: dict[str, str] | None = None) -> list[str]:
        """Every broken promise (empty: all kept).

        Args:
            expected: URLs the crawl must store, each once (poison URLs included).
            poison: ``{URL: text its dead letter's reason must contain}``: the only messages
                allowed to be dead-lettered.
        """
        poison = poison or {}
        found: list[str] = []
        if lost := self.lost(expected):
            found.append(f"{len(lost)} URLs lost, e.g. {sorted(lost)[:5]}")
        if extra := set(self.urls) - expected:
            found.append(f"{len(extra)} URLs not in the reachable set, e.g. {sorted(extra)[:5]}")
        if self.duplicates:
            twice = [url for url, count in self.urls.items() if count > 1]
            found.append(f"{self.duplicates} duplicate results, e.g. {twice[:5]}")
        if self.final is None:
            found.append(f"job did not end within the timeout; ledger {self.counters}")
        elif self.final.kind is not JobEventKind.COMPLETED:
            found.append(f"job ended {self.final.kind}: {self.final.reason}")
        if self.completions != 1:
            found.append(f"{self.completions} completion events")
        failed = {str(r["url"]) for r in self.results if r["outcome"] == "failed"}
        if failed != set(poison):
            found.append(f"failed results {sorted(failed)}, expected {sorted(poison)}")
        matched = self.letter_urls(poison)
        if len(self.letters) != len(poison) or set(matched) != set(poison):
            found.append(f"{len(self.letters)} dead letters, expected one for each of "
                         f"{sorted(poison)}: {[(d.stage, d.reason) for d in self.letters]}")
        for url, text in poison.items():
            letter = matched.get(url)
            if letter is not None and text not in letter.reason:
                found.append(f"dead letter of {url}: reason {letter.reason!r} lacks {text!r}")
        return found

    def summary(self) -> str:
        outcomes = collections.Counter(str(r["outcome"]) for r in self.results)
        return (f"job {self.job}: {len(self.results)} results ({len(self.urls)} URLs, "
                f"{self.duplicates} duplicates), outcomes {dict(outcomes)}, "
                f"{self.completions} completion events, {len(self.letters)} dead letters "
                f"{[(str(d.stage), d.reason[:80]) for d in self.letters]}, ledger "
                f"{self.counters}, {self.wall_s:.1f} s")


async def crawl_under_faults(mesh: ChaosMesh, request: CrawlRequest, faults: Faults,
                             timeout_s: float) -> CrawlReport:
    """Submit ``request`` as the ``default`` tenant, run ``faults`` until it returns, wait
    for the job's final event (at most ``timeout_s`` seconds from the start; a fault script
    still running then is cancelled), then read what it produced (``final`` None if the job
    did not end in time)."""
    assert mesh.settings is not None
    started = time.monotonic()
    async with open_session(mesh.settings, None, DEFAULT_TENANT) as session:
        job = await submit(session.tenant, request, timeout_s=60)
        waiting = asyncio.create_task(wait_for_job(session.tenant, job, show=False,
                                                   counts=lambda: session.counts(job)))
        final: JobEvent | None = None
        try:
            async with asyncio.timeout(timeout_s):
                await faults(waiting.done)
                final = await waiting
        except TimeoutError:
            pass
        finally:
            waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting
        wall_s = time.monotonic() - started
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "results.jsonl"
            await export_results(session.tenant, job, out)
            results = [orjson.loads(line) for line in out.read_bytes().splitlines() if line]
        events = await read_events(session.tenant.jetstream(), job)
        completions = sum(e.kind is JobEventKind.COMPLETED for e in events)
        assert session.mesh is not None
        letters = await dead_letters(session.mesh, mesh.tenant_id, job)
        counters = await session.counts(job)
    return CrawlReport(job, final, results, completions, letters, wall_s, counters)


async def until(predicate: Callable[[], bool], done: Callable[[], bool],
                timeout_s: float = 120) -> bool:
    """Wait (polling every 50 ms) until ``predicate()``; False if the job ended first.

    Raises:
        TimeoutError: neither happened within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if done():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for a fault's moment")
        await asyncio.sleep(0.05)
    return True


async def until_async(check: Callable[[], Awaitable[bool]], timeout_s: float = 120) -> None:
    """Wait (polling every 200 ms) until ``await check()`` is true.

    Raises:
        TimeoutError: not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for a fault's moment")
        await asyncio.sleep(0.2)
