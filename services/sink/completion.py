"""Job completion: exactly once, when no work for the job remains anywhere in the mesh.

A job is complete when its seeds were expanded and its ledger counts as many finished
pages as admitted ones. Dedup publishes a page's ``admitted`` entries before the
expansion report of the page that discovered them, so every finished page's children are
already counted: ``finished == admitted`` means nothing is left. Never inferred from
idleness or a timeout.

The ``completed`` event is published first (its ``Nats-Msg-Id`` makes racing sinks store
it once) and the job record is then moved to ``completed`` by compare-and-set.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from shared import subjects
from shared.contracts import JobCounters, JobEvent, JobEventKind, JobRecord, JobState
from shared.contracts.base import Contract
from shared.subjects import Stage
from shared.telemetry import metrics


class Publisher(Protocol):
    async def publish(self, subject: str, message: Contract, msg_id: str) -> bool: ...


class Jobs(Protocol):
    async def cached(self, tenant: str, job: str) -> JobRecord | None: ...

    async def get(self, tenant: str, job: str) -> tuple[JobRecord, int]: ...

    async def transition(self, tenant: str, job: str, to: JobState,
                         counters: JobCounters | None = None) -> bool: ...


Counter = Callable[[str, str], Awaitable[JobCounters]]


class CompletionTracker:
    """Checks jobs for completion and emits progress (every ``progress_every`` pages)."""

    def __init__(self, publisher: Publisher, jobs: Jobs, counts: Counter,
                 progress_every: int = 100) -> None:
        self.publisher = publisher
        self.jobs = jobs
        self.counts = counts
        self.progress_every = progress_every

    async def running(self, tenant: str, job: str) -> bool:
        """False for unknown, completed or cancelled jobs (their pages are dropped)."""
        record = await self.jobs.cached(tenant, job)
        return record is not None and record.state is JobState.RUNNING

    async def check(self, tenant: str, job: str) -> bool:
        """Complete the job if no work remains; True if it is (now) completed."""
        counts = await self.counts(tenant, job)
        if counts.finished and counts.finished % self.progress_every == 0:
            await self.publisher.publish(
                subjects.events(tenant, job),
                JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.PROGRESS, counters=counts),
                subjects.msg_id(Stage.SINK, tenant, job, f"progress-{counts.finished}"),
            )
        if not counts.seeded or counts.finished < counts.admitted:
            return False
        record, _ = await self.jobs.get(tenant, job)
        if record.state is JobState.COMPLETED:
            return True
        if record.state is not JobState.RUNNING:
            return False
        await self.publisher.publish(
            subjects.events(tenant, job),
            JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.COMPLETED, counters=counts),
            subjects.msg_id(Stage.SINK, tenant, job, "completed"),
        )
        if await self.jobs.transition(tenant, job, JobState.COMPLETED, counts):
            metrics.JOBS_COMPLETED.labels(tenant).inc()  # this process completed it
        return True
