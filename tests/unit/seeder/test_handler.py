"""The seeder handler: a submission becomes a job record, a ``started`` event, the seed
links and (when asked) a reply; an invalid one a ``rejected`` event and reply.

The job store is an in-memory fake of the handler's :class:`JobStore` protocol.
"""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from services.seeder.handler import RawSubmission, SeederHandler, job_id_for
from shared import subjects
from shared.accounts.claims import TenantQuota
from shared.bus.loop import Delivery, Outbound
from shared.contracts import (
    CrawlRequest,
    DiscoveredLinks,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    LinkOrigin,
)
from shared.subjects import Stage
from shared.tenancy import TenantRecord, TenantStatus

TENANT = "ATESTTENANT"
INBOX = "_INBOX.client.42"
PUBLISHED = datetime(2025, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)


class MemoryJobs:
    def __init__(self) -> None:
        self.records: dict[tuple[str, str], JobRecord] = {}

    async def create(self, record: JobRecord) -> JobRecord:
        return self.records.setdefault((record.tenant, record.job_id), record)

    async def cached(self, tenant: str, job: str) -> JobRecord | None:
        return self.records.get((tenant, job))

    async def running_count(self, tenant: str) -> int:
        return sum(1 for r in self.records.values()
                   if r.tenant == tenant and r.state is JobState.RUNNING)


class Tenants:
    def __init__(self, quota: TenantQuota | None = None,
                 status: TenantStatus = TenantStatus.ACTIVE) -> None:
        self.found: TenantRecord | None = TenantRecord(
            name="test", id=TENANT, status=status, quota=quota or TenantQuota())

    async def record(self, tenant: str, fresh: bool = False) -> TenantRecord | None:
        return self.found if self.found and tenant == self.found.id else None


def seeder(jobs: MemoryJobs | None = None, tenants: Tenants | None = None) -> SeederHandler:
    return SeederHandler(jobs if jobs is not None else MemoryJobs(), tenants or Tenants())


def delivery(seq: int = 7, delivered: int = 1, published_at: datetime | None = PUBLISHED) -> Delivery:
    return Delivery(subject=subjects.seeds(TENANT), headers={}, delivered=delivered,
                    stream_seq=seq, tenant=TENANT, job=subjects.NO_JOB, published_at=published_at)


def submission(**fields: object) -> RawSubmission:
    return RawSubmission(orjson.dumps({"seeds": ["https://example.org/"], **fields}))


def of_type(outputs: list[Outbound], kind: type) -> list[Outbound]:
    return [o for o in outputs if isinstance(o.message, kind)]


async def test_an_accepted_submission_starts_the_job_and_sends_no_reply() -> None:
    jobs = MemoryJobs()
    outputs = await seeder(jobs).handle(
        submission(seeds=["https://example.org/", "https://example.net/x"], reply_to=INBOX,
                   max_pages=5),
        delivery())
    job = job_id_for(delivery())

    (record,) = jobs.records.values()
    assert (record.tenant, record.job_id, record.state) == (TENANT, job, JobState.RUNNING)
    assert record.request.max_pages == 5

    (started,) = of_type(outputs, JobEvent)
    assert started.subject == subjects.events(TENANT, job)
    assert started.msg_id == subjects.msg_id(Stage.SEEDER, TENANT, job, "started")
    assert started.message.kind is JobEventKind.STARTED  # type: ignore[attr-defined]
    assert not started.core

    (seeds,) = of_type(outputs, DiscoveredLinks)
    assert seeds.subject == subjects.links(TENANT, job)
    assert seeds.msg_id == subjects.msg_id(Stage.SEEDER, TENANT, job, "seeds")
    links = seeds.message
    assert isinstance(links, DiscoveredLinks)
    assert (links.origin, links.depth, links.source_fingerprint) == (LinkOrigin.SEED, 0, None)
    assert [link.url for link in links.links] == ["https://example.org/", "https://example.net/x"]

    assert [o for o in outputs if o.core or o.subject == INBOX] == []


async def test_a_bare_url_starts_a_job_without_a_reply() -> None:
    outputs = await seeder().handle(RawSubmission(b"https://example.org/"),
                                                      delivery())
    assert [type(o.message) for o in outputs] == [JobEvent, DiscoveredLinks]


async def test_a_client_chosen_job_id_is_used() -> None:
    jobs = MemoryJobs()
    outputs = await seeder(jobs).handle(submission(job_id="nightly-1"), delivery())
    assert (TENANT, "nightly-1") in jobs.records
    assert of_type(outputs, DiscoveredLinks)[0].subject == subjects.links(TENANT, "nightly-1")


async def test_a_rejected_submission_gets_a_rejected_event_only() -> None:
    jobs = MemoryJobs()
    outputs = await seeder(jobs).handle(
        submission(seeds=["ftp://example.org/file"], reply_to=INBOX), delivery())
    assert jobs.records == {}
    job = job_id_for(delivery())

    (event,) = of_type(outputs, JobEvent)
    assert event.subject == subjects.events(TENANT, job)
    assert event.msg_id == subjects.msg_id(Stage.SEEDER, TENANT, job, "rejected")
    rejected = event.message
    assert isinstance(rejected, JobEvent) and rejected.kind is JobEventKind.REJECTED
    assert rejected.reason is not None and "unsupported scheme 'ftp'" in rejected.reason

    assert [type(o.message) for o in outputs] == [JobEvent]


async def test_a_rejection_without_a_usable_inbox_sends_no_reply() -> None:
    handler = seeder()
    for raw in (b"ftp://example.org/", b"{broken", b"\xff\xfe",
                orjson.dumps({"seeds": [], "reply_to": "crawl.seeds.OTHER"})):
        outputs = await handler.handle(RawSubmission(raw), delivery())
        assert [type(o.message) for o in outputs] == [JobEvent], raw
        assert outputs[0].message.kind is JobEventKind.REJECTED  # type: ignore[attr-defined]


async def test_an_unknown_field_is_rejected_with_its_name() -> None:
    outputs = await seeder().handle(submission(colour="blue", reply_to=INBOX),
                                                      delivery())
    (event,) = of_type(outputs, JobEvent)
    assert event.message.kind is JobEventKind.REJECTED  # type: ignore[attr-defined]
    assert "colour" in (event.message.reason or "")  # type: ignore[attr-defined]


def test_job_id_is_deterministic_per_delivery() -> None:
    assert job_id_for(delivery(seq=7)) == job_id_for(delivery(seq=7, delivered=3))
    assert job_id_for(delivery(seq=7)) != job_id_for(delivery(seq=8))
    millis = int(PUBLISHED.timestamp() * 1000)
    assert job_id_for(delivery(seq=7)) == f"{millis:012x}00000007"
    assert job_id_for(delivery(seq=7, published_at=None)) == "00000000000000000007"
    subjects.check_token(job_id_for(delivery(seq=2**32 - 1)), "job id")


async def test_a_redelivery_reproduces_the_same_job_and_outputs() -> None:
    jobs = MemoryJobs()
    handler = seeder(jobs)
    first = await handler.handle(submission(reply_to=INBOX), delivery(delivered=1))
    again = await handler.handle(submission(reply_to=INBOX), delivery(delivered=2))
    assert len(jobs.records) == 1
    assert [(o.subject, o.msg_id, o.message) for o in again if not isinstance(o.message, JobEvent)] \
        == [(o.subject, o.msg_id, o.message) for o in first if not isinstance(o.message, JobEvent)]
    assert [(o.subject, o.msg_id) for o in again] == [(o.subject, o.msg_id) for o in first]
    assert of_type(again, DiscoveredLinks)


async def test_a_job_id_already_used_by_another_request_is_rejected() -> None:
    jobs = MemoryJobs()
    handler = seeder(jobs)
    await handler.handle(submission(job_id="mine"), delivery(seq=1))
    outputs = await handler.handle(
        submission(job_id="mine", seeds=["https://other.example/"], reply_to=INBOX),
        delivery(seq=2))
    (event,) = of_type(outputs, JobEvent)
    assert event.message.kind is JobEventKind.REJECTED  # type: ignore[attr-defined]
    assert "already in use" in (event.message.reason or "")  # type: ignore[attr-defined]
    assert of_type(outputs, DiscoveredLinks) == []
    assert jobs.records[(TENANT, "mine")].request.seeds == ("https://example.org/",)


async def test_the_request_stored_is_the_one_submitted() -> None:
    jobs = MemoryJobs()
    await seeder(jobs).handle(submission(max_depth=0, reply_to=INBOX), delivery())
    (record,) = jobs.records.values()
    assert record.request == CrawlRequest(seeds=("https://example.org/",), max_depth=0,
                                          reply_to=INBOX)


async def test_max_pages_above_the_tenant_limit_is_rejected_and_unset_is_capped() -> None:
    tenants = Tenants(TenantQuota(max_pages_per_job=50))
    jobs = MemoryJobs()
    outputs = await seeder(jobs, tenants).handle(submission(max_pages=51), delivery(seq=1))
    (event,) = outputs
    assert event.message.kind is JobEventKind.REJECTED  # type: ignore[attr-defined]
    assert event.message.reason == ("max_pages 51 exceeds this tenant's limit of 50 pages "  # type: ignore[attr-defined]
                                    "per job")
    assert jobs.records == {}

    outputs = await seeder(jobs, tenants).handle(submission(), delivery(seq=2))
    assert of_type(outputs, DiscoveredLinks)
    (record,) = jobs.records.values()
    assert record.request.max_pages == 50
    again = await seeder(jobs, tenants).handle(submission(), delivery(seq=2, delivered=2))
    assert [o.msg_id for o in again] == [o.msg_id for o in outputs]  # redelivery: same job


async def test_the_concurrent_jobs_limit_rejects_a_submission_until_a_job_ends() -> None:
    tenants = Tenants(TenantQuota(max_concurrent_jobs=2))
    jobs = MemoryJobs()
    handler = seeder(jobs, tenants)
    for seq in (1, 2):
        assert of_type(await handler.handle(submission(), delivery(seq=seq)), DiscoveredLinks)
    again = await handler.handle(submission(), delivery(seq=2, delivered=2))
    assert of_type(again, DiscoveredLinks)  # a redelivery of a started job is not refused
    (event,) = await handler.handle(submission(), delivery(seq=3))
    assert event.message.kind is JobEventKind.REJECTED  # type: ignore[attr-defined]
    assert "limit of concurrent jobs is 2" in (event.message.reason or "")  # type: ignore[attr-defined]
    first = next(iter(jobs.records))
    jobs.records[first] = jobs.records[first].model_copy(update={"state": JobState.COMPLETED})
    assert of_type(await handler.handle(submission(), delivery(seq=4)), DiscoveredLinks)


async def test_a_suspended_or_unknown_tenant_is_rejected() -> None:
    (event,) = await seeder(tenants=Tenants(status=TenantStatus.SUSPENDED)).handle(
        submission(), delivery())
    assert "suspended" in (event.message.reason or "")  # type: ignore[attr-defined]
    unknown = Tenants()
    unknown.found = None
    (event,) = await seeder(tenants=unknown).handle(submission(), delivery())
    assert event.message.kind is JobEventKind.REJECTED  # type: ignore[attr-defined]
    assert "unknown tenant" in (event.message.reason or "")  # type: ignore[attr-defined]
