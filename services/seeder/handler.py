"""The seeder's handler: submission in; job record, ``started`` event and seed links out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.seeder.intake import SubmissionError, parse_submission
from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.contracts import (
    CrawlRequest,
    DiscoveredLinks,
    JobEvent,
    JobEventKind,
    JobRecord,
    Link,
    LinkOrigin,
)
from shared.subjects import Stage
from shared.tenancy import TenantRecord, TenantStatus


class JobStore(Protocol):
    """Where job records live (the ``jobs`` KV bucket in production)."""

    async def create(self, record: JobRecord) -> JobRecord:
        """Store ``record`` unless the job exists; return the stored record either way."""
        ...

    async def cached(self, tenant: str, job: str) -> JobRecord | None:
        """The job's record, or None."""
        ...

    async def running_count(self, tenant: str) -> int:
        """How many jobs of ``tenant`` are running."""
        ...


class TenantSource(Protocol):
    """The tenant registry as the seeder reads it (:class:`shared.tenantgate.TenantGate`)."""

    async def record(self, tenant: str, fresh: bool = False) -> TenantRecord | None: ...


@dataclass(frozen=True, slots=True)
class RawSubmission:
    """The intake payload, undecoded: the seeder validates it itself to reply clearly."""

    data: bytes


def job_id_for(delivery: Delivery) -> str:
    """A job id that a redelivery of the same submission reproduces.

    Millisecond publish time (hex) + intake stream sequence (hex): time-ordered, unique
    per tenant, deterministic for redeliveries.
    """
    millis = int(delivery.published_at.timestamp() * 1000) if delivery.published_at else 0
    return f"{millis:012x}{delivery.stream_seq:08x}"


class SeederHandler:
    """Validates a submission, enforces the tenant's crawl limits and starts its job.

    The tenant is the one whose intake slot the submission arrived on (the subject), never
    a payload field. A submission is rejected (a ``rejected`` event on the tenant's EVENTS,
    with the reason) when it is invalid, its job id is taken, the tenant is suspended or
    unknown, it asks for more than the quota's ``max_pages_per_job`` (a request that does
    not say is capped to it), or the tenant already runs ``max_concurrent_jobs`` jobs.

    Answers go to EVENTS only: a payload ``reply_to`` names a subject in MESH's account,
    which no tenant can subscribe to, so no reply is sent there.
    """

    def __init__(self, jobs: JobStore, tenants: TenantSource) -> None:
        self.jobs = jobs
        self.tenants = tenants

    async def handle(self, message: RawSubmission, delivery: Delivery) -> list[Outbound]:
        tenant = delivery.tenant
        try:
            request = parse_submission(message.data)
        except SubmissionError as error:
            return self._reject(tenant, job_id_for(delivery), str(error))
        job = request.job_id or job_id_for(delivery)
        existing = await self.jobs.cached(tenant, job)
        if existing is None:
            record = await self.tenants.record(tenant, fresh=True)
            if "max_pages" not in request.model_fields_set and record is not None:
                request = request.model_copy(update={
                    "max_pages": min(request.max_pages, record.quota.max_pages_per_job)})
            if (reason := await self._refusal(tenant, record, request)) is not None:
                return self._reject(tenant, job, reason)
        stored = await self.jobs.create(JobRecord(tenant=tenant, job_id=job, request=request))
        capped = "max_pages" not in request.model_fields_set
        if stored.request != request and not (capped and _same_but_capped(stored.request,
                                                                          request)):
            return self._reject(tenant, job, f"job id {job!r} is already in use")
        return [
            Outbound(
                subjects.events(tenant, job),
                JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.STARTED),
                subjects.msg_id(Stage.SEEDER, tenant, job, "started"),
            ),
            Outbound(
                subjects.links(tenant, job),
                DiscoveredLinks(
                    tenant=tenant, job_id=job, origin=LinkOrigin.SEED, depth=0,
                    links=tuple(Link(url=seed) for seed in stored.request.seeds),
                ),
                subjects.msg_id(Stage.SEEDER, tenant, job, "seeds"),
            ),
        ]

    async def _refusal(self, tenant: str, record: TenantRecord | None,
                       request: CrawlRequest) -> str | None:
        """Why the tenant may not start ``request`` now, or None."""
        if record is None:
            return f"unknown tenant {tenant}"
        if record.status is TenantStatus.SUSPENDED:
            return f"tenant {record.name} is suspended: submissions are refused until resumed"
        quota = record.quota
        if request.max_pages > quota.max_pages_per_job:
            return (f"max_pages {request.max_pages} exceeds this tenant's limit of "
                    f"{quota.max_pages_per_job} pages per job")
        running = await self.jobs.running_count(tenant)
        if running >= quota.max_concurrent_jobs:
            return (f"{running} jobs are running, this tenant's limit of concurrent jobs is "
                    f"{quota.max_concurrent_jobs}: wait for one to finish or cancel one")
        return None

    def _reject(self, tenant: str, job: str, reason: str) -> list[Outbound]:
        return [
            Outbound(
                subjects.events(tenant, job),
                JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.REJECTED, reason=reason),
                subjects.msg_id(Stage.SEEDER, tenant, job, "rejected"),
            )
        ]


def _same_but_capped(stored: CrawlRequest, request: CrawlRequest) -> bool:
    """True if ``stored`` is ``request`` with ``max_pages`` capped by the quota."""
    return (stored.model_copy(update={"max_pages": request.max_pages}) == request
            and stored.max_pages <= request.max_pages)


__all__ = ["CrawlRequest", "RawSubmission", "SeederHandler", "job_id_for"]
