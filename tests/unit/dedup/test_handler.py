"""The dedup handler: canonical URLs, scope and depth, then admission; its outputs and order.

Admission and the job store are in-memory fakes of the handler's own protocols
(:class:`Admission`, :class:`JobSource`); the real KV admission is covered by
``tests/integration/test_admission.py``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.dedup.admission import Candidate
from services.dedup.handler import DedupHandler
from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.bus.outcomes import UnprocessableError
from shared.contracts import (
    CrawlRequest,
    DiscoveredLinks,
    FrontierEntry,
    JobRecord,
    JobState,
    LedgerEntry,
    Link,
    LinkOrigin,
    PageExpanded,
)
from shared.jobs import ledger_msg_id
from shared.subjects import LedgerKind, Stage
from shared.urls import canonical_url, fingerprint

TENANT, JOB = "ATESTTENANT", "0190aa00bb11cc22"
SOURCE_FP = "0123456789abcdef0123456789abcdef"


class FakeAdmission:
    """Admits each fingerprint once per (tenant, job), up to ``max_pages``; logs calls."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, str], str] = {}
        self.calls: list[tuple[list[Candidate], str, int, int]] = []

    async def admit(self, tenant: str, job: str, candidates: list[Candidate], cause: str,
                    max_pages: int, max_pages_per_host: int) -> list[Candidate]:
        self.calls.append((list(candidates), cause, max_pages, max_pages_per_host))
        admitted = []
        for cand in candidates:
            key = (tenant, job, cand.fingerprint)
            if key not in self.seen:
                used = sum(1 for t, j, _ in self.seen if (t, j) == (tenant, job))
                if used >= max_pages:
                    continue
                self.seen[key] = cause
            if self.seen[key] == cause:
                admitted.append(cand)
        return admitted


class FakeJobs:
    def __init__(self, *records: JobRecord) -> None:
        self.records = {(r.tenant, r.job_id): r for r in records}

    async def cached(self, tenant: str, job: str) -> JobRecord | None:
        return self.records.get((tenant, job))


def record(state: JobState = JobState.RUNNING, **request: object) -> JobRecord:
    req = CrawlRequest.model_validate({"seeds": ["https://site.test/"], **request})
    return JobRecord(tenant=TENANT, job_id=JOB, request=req, state=state)


def links(*urls: str, depth: int = 1, source: str | None = SOURCE_FP, part: int = 0) -> DiscoveredLinks:
    return DiscoveredLinks(
        tenant=TENANT, job_id=JOB, depth=depth, part=part,
        origin=LinkOrigin.OUTLINKS if source else LinkOrigin.SEED,
        source_url="https://site.test/" if source else None, source_fingerprint=source,
        links=tuple(Link(url=u) for u in urls),
    )


def delivery() -> Delivery:
    return Delivery(subject=subjects.links(TENANT, JOB), headers={}, delivered=1,
                    stream_seq=1, tenant=TENANT, job=JOB)


def make(state: JobState = JobState.RUNNING, **request: object) -> tuple[DedupHandler, FakeAdmission]:
    admission = FakeAdmission()
    return DedupHandler(admission, FakeJobs(record(state, **request))), admission


def frontier(outputs: list[Outbound]) -> list[FrontierEntry]:
    return [o.message for o in outputs if isinstance(o.message, FrontierEntry)]


def expanded(outputs: list[Outbound]) -> PageExpanded:
    (report,) = [o.message for o in outputs if isinstance(o.message, PageExpanded)]
    return report


def cause_of(source: str, part: int = 0) -> str:
    return subjects.msg_id(Stage.DEDUP, TENANT, JOB, f"from-{source}-{part}")


async def test_equivalent_urls_are_merged_into_one_canonical_url() -> None:
    handler, admission = make()
    outputs = await handler.handle(links(
        "https://site.test/a?b=2&a=1#top",
        "https://SITE.test:443/a?a=1&b=2",
        "https://site.test/a?a=1&b=2#other",
        "https://site.test/b",
    ), delivery())
    urls = [entry.url for entry in frontier(outputs)]
    assert urls == ["https://site.test/a?a=1&b=2", "https://site.test/b"]
    (candidates, _, _, _), = admission.calls
    assert [c.fingerprint for c in candidates] == [fingerprint(u) for u in urls]
    report = expanded(outputs)
    assert (report.links_seen, report.admitted) == (4, 2)


async def test_out_of_scope_unparseable_and_too_long_links_are_not_admitted() -> None:
    handler, admission = make()
    outputs = await handler.handle(links(
        "https://other.test/x",            # another host (same-host scope)
        "ftp://site.test/file",            # not http(s)
        "https://site.test/" + "a" * 2100,  # over the URL length limit
        "https://site.test/ok",
    ), delivery())
    assert [e.url for e in frontier(outputs)] == ["https://site.test/ok"]
    assert [c.host for c in admission.calls[0][0]] == ["site.test"]
    assert expanded(outputs).links_seen == 4


async def test_links_deeper_than_max_depth_are_not_admitted() -> None:
    handler, admission = make(max_depth=2)
    at_limit = await handler.handle(links("https://site.test/2", depth=2), delivery())
    too_deep = await handler.handle(links("https://site.test/3", depth=3), delivery())
    assert [e.depth for e in frontier(at_limit)] == [2]
    assert frontier(too_deep) == []
    assert admission.calls[-1][0] == []
    assert (expanded(too_deep).links_seen, expanded(too_deep).admitted) == (1, 0)


async def test_limits_of_the_request_reach_admission() -> None:
    handler, admission = make(max_pages=7, max_pages_per_host=3)
    await handler.handle(links("https://site.test/a"), delivery())
    (_, _, max_pages, per_host), = admission.calls
    assert (max_pages, per_host) == (7, 3)


async def test_unknown_job_is_unprocessable() -> None:
    handler = DedupHandler(FakeAdmission(), FakeJobs())
    with pytest.raises(UnprocessableError, match=JOB):
        await handler.handle(links("https://site.test/a"), delivery())


@pytest.mark.parametrize("state", [JobState.CANCELLED, JobState.COMPLETED])
async def test_a_job_no_longer_running_admits_nothing_but_still_reports_expansion(
    state: JobState,
) -> None:
    handler, admission = make(state)
    outputs = await handler.handle(links("https://site.test/a", "https://site.test/b"), delivery())
    assert len(outputs) == 1
    report = expanded(outputs)
    assert report.fingerprint == SOURCE_FP
    assert (report.links_seen, report.admitted, report.admitted_fingerprints) == (2, 0, ())
    assert outputs[0].msg_id == cause_of(SOURCE_FP)
    assert admission.calls[0][0] == []


async def test_outputs_frontier_on_the_host_partition_ledger_first_then_expansion() -> None:
    handler, admission = make(scope={"mode": "any"})
    urls = ["https://site.test/a", "http://other.test:8080/b"]
    outputs = await handler.handle(links(*urls), delivery())

    cause = cause_of(SOURCE_FP)
    assert admission.calls[0][1] == cause
    for url in urls:
        canonical = canonical_url(url)
        fp = fingerprint(canonical)
        host = canonical.split("/")[2]
        (entry_out,) = [o for o in outputs if isinstance(o.message, FrontierEntry)
                        and o.message.fingerprint == fp]
        assert entry_out.subject == subjects.frontier(subjects.partition_of(host), TENANT, JOB)
        assert entry_out.msg_id == subjects.msg_id(Stage.DEDUP, TENANT, JOB, fp)
        assert entry_out.phase == 0
        assert entry_out.message == FrontierEntry(
            tenant=TENANT, job_id=JOB, url=canonical, fingerprint=fp, host=host, depth=1,
            admitted_at=entry_out.message.admitted_at,
        )
        (ledger_out,) = [o for o in outputs if isinstance(o.message, LedgerEntry)
                         and o.message.fingerprint == fp]
        assert ledger_out.subject == subjects.ledger(TENANT, JOB, LedgerKind.ADMITTED)
        assert ledger_out.message.kind == "admitted"
        assert ledger_out.msg_id == ledger_msg_id(TENANT, JOB, LedgerKind.ADMITTED, fp)
        assert ledger_out.phase == 0
    assert frontier(outputs)[1].host == "other.test:8080"

    (report_out,) = [o for o in outputs if isinstance(o.message, PageExpanded)]
    assert report_out.subject == subjects.expanded(TENANT, JOB)
    assert report_out.msg_id == cause
    assert report_out.phase == 1
    assert report_out.message.admitted_fingerprints == tuple(
        fingerprint(canonical_url(u)) for u in urls)
    assert {o.phase for o in outputs if o is not report_out} == {0}


async def test_seeds_report_with_no_fingerprint_and_a_seeds_cause() -> None:
    handler, admission = make()
    outputs = await handler.handle(links("https://site.test/", depth=0, source=None), delivery())
    assert [e.depth for e in frontier(outputs)] == [0]
    report = expanded(outputs)
    assert report.fingerprint is None
    assert admission.calls[0][1] == cause_of("seeds")
    assert [o.msg_id for o in outputs if isinstance(o.message, PageExpanded)] == [cause_of("seeds")]


async def test_the_same_links_from_two_pages_are_admitted_once() -> None:
    handler, _ = make()
    first = await handler.handle(links("https://site.test/a", "https://site.test/b"), delivery())
    second = await handler.handle(
        links("https://site.test/b#x", "https://site.test/c", source="f" * 32), delivery())
    assert [e.url for e in frontier(first)] == ["https://site.test/a", "https://site.test/b"]
    assert [e.url for e in frontier(second)] == ["https://site.test/c"]
    assert expanded(second).admitted == 1


async def test_a_redelivery_produces_the_same_outputs_with_the_same_ids() -> None:
    handler, _ = make()
    message = links("https://site.test/a", "https://site.test/b")
    first = await handler.handle(message, delivery())
    again = await handler.handle(message, delivery())
    assert [(o.subject, o.msg_id) for o in again] == [(o.subject, o.msg_id) for o in first]


async def test_a_page_of_10000_links_does_not_stall_the_event_loop() -> None:
    """Screening 10,000 links takes 1-2 s of CPU: on the event loop it stopped the
    ``in_progress`` heartbeat, so the message was redelivered and dead-lettered (its links
    lost). It runs in a worker thread: the loop is never blocked for long."""
    class FirstHundred:
        async def admit(self, tenant: str, job: str, candidates: list[Candidate], cause: str,
                        max_pages: int, max_pages_per_host: int) -> list[Candidate]:
            return candidates[:100]

    handler = DedupHandler(FirstHundred(), FakeJobs(record()))
    message = links(*(f"https://site.test/item/{n}?ref=list" for n in range(10_000)))
    longest = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal longest
        while not stop.is_set():
            began = time.monotonic()
            await asyncio.sleep(0.01)
            longest = max(longest, time.monotonic() - began)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker runs from here on
    try:
        outputs = await handler.handle(message, delivery())
    finally:
        stop.set()
        await task
    assert sum(isinstance(o.message, FrontierEntry) for o in outputs) == 100
    assert longest < 0.5, f"the event loop was blocked for {longest:.2f} s"


async def test_a_redirect_target_keeps_its_hop_count() -> None:
    handler, _ = make()
    message = links("https://site.test/moved").model_copy(
        update={"origin": LinkOrigin.REDIRECT, "redirects": 3})
    outputs = await handler.handle(message, delivery())
    (entry,) = [o.message for o in outputs if isinstance(o.message, FrontierEntry)]
    assert entry.redirects == 3
