"""The sink's three handlers against real KV buckets and streams.

The handlers are built by :func:`services.sink.main.setup` exactly as the service builds
them. Dedup's side is simulated the way dedup does it: a ``pages`` KV key
``admitted <cause>`` and an ``admitted`` ledger entry per admitted page (phase 0), then the
:class:`PageExpanded` report (phase 1). The job is complete when exactly one ``completed``
event is in the tenant's ``EVENTS``, with one result per page in its ``RESULTS`` — both
read through a connection of the tenant's own account (operator mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.sink.handler import DeadLetterHandler, ExpansionHandler, ResultHandler
from services.sink.main import setup
from shared import subjects
from shared.bus.connection import connect
from shared.bus.loop import Delivery
from shared.bus.service import LoopSpec, run_loops
from shared.codec import decode, encode
from shared.contracts import (
    CrawlRequest,
    DeadLetter,
    DiscoveredLinks,
    FetchedPage,
    JobCounters,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    LedgerEntry,
    Link,
    LinkOrigin,
    Outcome,
    PageExpanded,
    PageResult,
    ParsedPage,
)
from shared.jobs import JobStore, ledger_counts, ledger_msg_id
from shared.settings import MeshSettings
from shared.streams import DLQ, EVENTS, EXPANDED, PAGES_BUCKET, PARSED, RESULTS
from shared.subjects import LedgerKind, Stage
from shared.urls import canonical_url, fingerprint
from tests.conftest import tenant_js

T = TypeVar("T")
SITE = "https://site.test"


@dataclass
class Sink:
    """One sink replica's handlers."""

    results: ResultHandler
    expansions: ExpansionHandler
    dead_letters: DeadLetterHandler


async def sink(nc: Client, settings: MeshSettings) -> Sink:
    specs: dict[str, object] = {}
    for spec in await setup(nc, settings):
        if isinstance(spec, LoopSpec):
            specs[spec.consumer.durable] = spec.handler
        else:  # one loop per tenant, the same handler for every tenant
            specs[spec.name] = spec.factory("ANYTENANT").handler
    return Sink(specs["sink"], specs["sink-expanded"], specs["sink-dlq"])  # type: ignore[arg-type]


def fp(path: str) -> str:
    return fingerprint(canonical_url(SITE + path))


def delivery(subject: str, tenant: str, job: str) -> Delivery:
    return Delivery(subject=subject, headers={}, delivered=1, stream_seq=1, tenant=tenant, job=job)


class Crawl:
    """A job and what dedup would have done for it."""

    def __init__(self, js: JetStreamContext, tenant: str, job: str,
                 tjs: JetStreamContext) -> None:
        self.js, self.tenant, self.job, self.tjs = js, tenant, job, tjs

    async def start(self, state: JobState = JobState.RUNNING) -> None:
        request = CrawlRequest(seeds=(SITE + "/",))
        await JobStore(self.js).create(JobRecord(tenant=self.tenant, job_id=self.job,
                                                 request=request, state=state))

    async def admit(self, source: str | None, *paths: str) -> PageExpanded:
        """Admit ``paths`` as links of page ``source`` (None: the seeds); return the report."""
        cause = subjects.msg_id(Stage.DEDUP, self.tenant, self.job,
                                f"from-{fp(source) if source else 'seeds'}-0")
        kv = await self.js.key_value(PAGES_BUCKET)
        for path in paths:
            await kv.create(f"{self.tenant}.{self.job}.{fp(path)}", f"admitted {cause}".encode())
            await self.js.publish(
                subjects.ledger(self.tenant, self.job, LedgerKind.ADMITTED),
                encode(LedgerEntry(tenant=self.tenant, job_id=self.job, kind="admitted",
                                   fingerprint=fp(path))),
                headers={"Nats-Msg-Id": ledger_msg_id(self.tenant, self.job,
                                                      LedgerKind.ADMITTED, fp(path))},
            )
        return PageExpanded(
            tenant=self.tenant, job_id=self.job, fingerprint=fp(source) if source else None,
            links_seen=len(paths) + 1, admitted=len(paths),
            admitted_fingerprints=tuple(fp(p) for p in paths),
        )

    def parsed(self, path: str, depth: int = 1, status: int = 200) -> ParsedPage:
        return ParsedPage(
            tenant=self.tenant, job_id=self.job, url=SITE + path, final_url=SITE + path,
            fingerprint=fp(path), depth=depth, status=status, content_type="text/html",
            fetched_at=datetime.now(UTC), title=f"title of {path}",
        )

    async def result(self, handlers: Sink, path: str, depth: int = 1) -> None:
        await handlers.results.handle(self.parsed(path, depth),
                                      delivery(subjects.parsed(self.tenant, self.job),
                                               self.tenant, self.job))

    async def expanded(self, handlers: Sink, report: PageExpanded) -> None:
        await handlers.expansions.handle(report, delivery(subjects.expanded(self.tenant, self.job),
                                                          self.tenant, self.job))

    async def stored(self, stream: str, subject: str) -> list[bytes]:
        """Messages on ``subject`` in the tenant's ``stream`` (read as the tenant; none if
        the stream does not exist)."""
        found: list[bytes] = []
        try:
            info = await self.tjs.stream_info(stream)
        except NotFoundError:
            return found
        if not info.state.messages:
            return found
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(NotFoundError):
                msg = await self.tjs.get_msg(stream, seq)
                if msg.subject == subject:
                    found.append(msg.data or b"")
        return found

    async def events(self, settings: MeshSettings) -> list[JobEvent]:
        return [decode(data, JobEvent)
                for data in await self.stored(EVENTS, f"crawl.events.{self.job}")]

    async def completions(self, settings: MeshSettings) -> list[JobEvent]:
        return [e for e in await self.events(settings) if e.kind is JobEventKind.COMPLETED]

    async def results(self, settings: MeshSettings) -> list[PageResult]:
        return [decode(data, PageResult)
                for data in await self.stored(RESULTS, f"crawl.results.{self.job}")]

    async def record(self) -> JobRecord:
        return (await JobStore(self.js).get(self.tenant, self.job))[0]


async def eventually(check: Callable[[], Awaitable[T]], what: str, timeout_s: float = 15.0) -> T:
    """Poll ``check`` every 50 ms until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(0.05)


@pytest.fixture
async def tjs(settings: MeshSettings, tenant: str) -> AsyncIterator[JetStreamContext]:
    """JetStream inside the tenant's own account."""
    async with tenant_js(settings, "test") as tjs_:
        yield tjs_


@pytest.fixture
async def crawl(js: JetStreamContext, tenant: str, job: str, tjs: JetStreamContext) -> Crawl:
    job_crawl = Crawl(js, tenant, job, tjs)
    await job_crawl.start()
    return job_crawl


@pytest.fixture
async def handlers(nc: Client, settings: MeshSettings) -> Sink:
    return await sink(nc, settings)


async def test_a_job_completes_once_with_one_result_per_page_despite_duplicates(
    crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    seeds = await crawl.admit(None, "/")
    await crawl.expanded(handlers, seeds)
    for _ in range(2):  # every parsed page handled twice (a redelivery)
        await crawl.result(handlers, "/", depth=0)
    await crawl.expanded(handlers, await crawl.admit("/", "/a", "/b"))
    assert await crawl.completions(settings) == []
    for path in ("/a", "/b"):
        await crawl.result(handlers, path)
        await crawl.result(handlers, path)
    await crawl.expanded(handlers, await crawl.admit("/a"))
    assert await crawl.completions(settings) == []  # /b is not expanded yet
    assert (await crawl.record()).state is JobState.RUNNING
    await crawl.expanded(handlers, await crawl.admit("/b"))

    (completed,) = await crawl.completions(settings)
    assert completed.counters == JobCounters(admitted=3, finished=3, failed=0, seeded=True)
    record = await crawl.record()
    assert record.state is JobState.COMPLETED and record.counters == completed.counters
    results = await crawl.results(settings)
    assert sorted(r.url for r in results) == [SITE + "/", SITE + "/a", SITE + "/b"]
    assert {r.outcome for r in results} == {Outcome.OK}

    # Redeliveries after completion change nothing.
    await crawl.result(handlers, "/b")
    await crawl.expanded(handlers, await crawl.admit("/b"))
    assert len(await crawl.completions(settings)) == 1
    assert len(await crawl.results(settings)) == 3
    assert await ledger_counts(crawl.js, crawl.tenant, crawl.job) == completed.counters


async def test_expansion_before_result_completes_on_the_last_result(
    crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    await crawl.expanded(handlers, await crawl.admit(None, "/"))
    await crawl.expanded(handlers, await crawl.admit("/", "/a", "/b"))
    await crawl.expanded(handlers, await crawl.admit("/a"))
    await crawl.expanded(handlers, await crawl.admit("/b"))
    await crawl.result(handlers, "/b")
    await crawl.result(handlers, "/a")
    assert await crawl.completions(settings) == []
    assert (await ledger_counts(crawl.js, crawl.tenant, crawl.job)).finished == 2
    await crawl.result(handlers, "/", depth=0)

    (completed,) = await crawl.completions(settings)
    assert completed.counters.finished == completed.counters.admitted == 3
    assert len(await crawl.results(settings)) == 3
    events = await crawl.events(settings)
    assert [e.kind for e in events] == [JobEventKind.COMPLETED]


async def test_two_sink_replicas_racing_on_every_message_complete_the_job_once(
    crawl: Crawl, nc: Client, settings: MeshSettings,
) -> None:
    other = await connect(settings, name="crawlmesh-test-sink-2")
    try:
        replicas = [await sink(nc, settings), await sink(other, settings)]
        paths = [f"/p{i}" for i in range(8)]
        reports = [await crawl.admit(None, "/"), await crawl.admit("/", *paths)]
        reports += [await crawl.admit(path) for path in paths]
        work = [crawl.expanded(r, report) for report in reports for r in replicas]
        work += [crawl.result(r, path) for path in ["/", *paths] for r in replicas]
        await asyncio.gather(*work)
    finally:
        await other.close()

    (completed,) = await crawl.completions(settings)
    assert completed.counters == JobCounters(admitted=9, finished=9, seeded=True)
    results = await crawl.results(settings)
    assert len(results) == 9 and len({r.fingerprint for r in results}) == 9
    assert (await crawl.record()).state is JobState.COMPLETED


async def test_a_dead_lettered_page_becomes_a_failed_result_and_finishes(
    crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    await crawl.expanded(handlers, await crawl.admit(None, "/", "/broken"))
    await crawl.result(handlers, "/", depth=0)
    await crawl.expanded(handlers, await crawl.admit("/"))
    page = FetchedPage(tenant=crawl.tenant, job_id=crawl.job, url=SITE + "/broken",
                       final_url=SITE + "/broken", fingerprint=fp("/broken"), depth=0,
                       status=200, content_type="text/html", body=b"<html>")
    letter = DeadLetter(
        id="FETCHED:7", tenant=crawl.tenant, job_id=crawl.job, stage="parser",
        reason="RuntimeError: boom", delivery_count=3,
        subject=subjects.fetched(crawl.tenant, crawl.job), stream="FETCHED", stream_seq=7,
        original=encode(page),
    )
    dlq = delivery(subjects.dlq(Stage.PARSER, crawl.tenant, crawl.job), crawl.tenant, crawl.job)
    await handlers.dead_letters.handle(letter, dlq)
    await handlers.dead_letters.handle(letter, dlq)  # redelivered

    (completed,) = await crawl.completions(settings)
    assert completed.counters == JobCounters(admitted=2, finished=2, failed=1, seeded=True)
    failed = [r for r in await crawl.results(settings) if r.outcome is Outcome.FAILED]
    assert [r.url for r in failed] == [SITE + "/broken"]
    assert failed[0].error == "dead-lettered by parser: RuntimeError: boom"


async def test_a_dead_lettered_seed_message_still_lets_the_job_complete(
    crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    seeds = DiscoveredLinks(tenant=crawl.tenant, job_id=crawl.job, origin=LinkOrigin.SEED,
                            depth=0, links=(Link(url=SITE + "/"),))
    letter = DeadLetter(
        id="LINKS:1", tenant=crawl.tenant, job_id=crawl.job, stage="dedup", reason="boom",
        delivery_count=3, subject=subjects.links(crawl.tenant, crawl.job), stream="LINKS",
        stream_seq=1, original=encode(seeds),
    )
    await handlers.dead_letters.handle(
        letter, delivery(subjects.dlq(Stage.DEDUP, crawl.tenant, crawl.job), crawl.tenant,
                         crawl.job))
    (completed,) = await crawl.completions(settings)
    assert completed.counters == JobCounters(seeded=True)


async def test_pages_of_a_cancelled_job_are_dropped(
    js: JetStreamContext, tenant: str, handlers: Sink, settings: MeshSettings,
    tjs: JetStreamContext,
) -> None:
    cancelled = Crawl(js, tenant, subjects.new_job_id(), tjs)
    await cancelled.start(JobState.CANCELLED)
    report = await cancelled.admit(None, "/")
    await cancelled.expanded(handlers, report)
    await cancelled.result(handlers, "/", depth=0)
    assert await cancelled.results(settings) == []
    assert await cancelled.events(settings) == []
    assert await ledger_counts(js, tenant, cancelled.job) == JobCounters(admitted=1)


@pytest.fixture
async def sink_loops(nc: Client, settings: MeshSettings) -> AsyncIterator[None]:
    """The sink's consume loops running in this process until the test ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_loops(nc, settings, await setup(nc, settings), stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


async def test_the_sink_loops_complete_a_job_from_its_streams(
    crawl: Crawl, js: JetStreamContext, settings: MeshSettings, sink_loops: None,
) -> None:
    """Through the streams: duplicates published under other msg ids (as after the duplicate
    window) and expansions racing results, in no particular order."""
    reports = [await crawl.admit(None, "/"), await crawl.admit("/", "/a", "/b")]
    reports += [await crawl.admit("/a"), await crawl.admit("/b")]
    sends = []
    for copy in range(2):
        for n, report in enumerate(reports):
            sends.append((subjects.expanded(crawl.tenant, crawl.job), encode(report),
                          f"test-expanded-{n}-{copy}"))
        for path, depth in (("/b", 1), ("/", 0), ("/a", 1)):
            sends.append((subjects.parsed(crawl.tenant, crawl.job),
                          encode(crawl.parsed(path, depth)), f"test-parsed-{path}-{copy}"))
    for subject, data, msg_id in sends:
        await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})

    async def completed() -> list[JobEvent]:
        return await crawl.completions(settings)

    (event,) = await eventually(completed, "the completed event")
    assert event.counters == JobCounters(admitted=3, finished=3, seeded=True)

    async def drained() -> bool:
        infos = [await js.stream_info(s.name) for s in (PARSED, EXPANDED)]
        return all(info.state.messages == 0 for info in infos)

    await eventually(drained, "the sink's input streams to be drained")
    assert len(await crawl.results(settings)) == 3
    assert len(await crawl.completions(settings)) == 1
    assert (await js.stream_info(DLQ.name)).state.messages == 0
