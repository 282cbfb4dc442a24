"""Job completion (:class:`services.sink.completion.CompletionTracker`): exactly once, only
when the seeds were expanded and every admitted page finished, event before state change.

The publisher, the job store and the ledger counts are in-memory fakes; a shared ``log``
records publishes and job transitions in the order they happen.
"""

from __future__ import annotations

import pytest

from services.sink.completion import CompletionTracker
from shared import subjects
from shared.contracts import (
    CrawlRequest,
    JobCounters,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
)
from shared.contracts.base import Contract
from shared.subjects import Stage

TENANT, JOB = "ATESTTENANT", "0190aa00bb11cc22"
EVENTS = subjects.events(TENANT, JOB)
COMPLETED_ID = subjects.msg_id(Stage.SINK, TENANT, JOB, "completed")


class Log(list[str]):
    """What happened, in order: ``publish <msg id>`` and ``transition <state>``."""


class FakePublisher:
    def __init__(self, log: Log) -> None:
        self.log = log
        self.sent: list[tuple[str, Contract, str]] = []
        self.failures = 0

    async def publish(self, subject: str, message: Contract, msg_id: str) -> None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("no PubAck")
        self.log.append(f"publish {msg_id}")
        self.sent.append((subject, message, msg_id))

    def events(self) -> list[JobEvent]:
        return [m for s, m, _ in self.sent if s == EVENTS and isinstance(m, JobEvent)]


class FakeJobs:
    """Job records with a revision; ``transition`` only moves a running job (like JobStore)."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.records: dict[tuple[str, str], tuple[JobRecord, int]] = {}

    def add(self, state: JobState = JobState.RUNNING) -> None:
        request = CrawlRequest(seeds=("https://site.test/",))
        self.records[(TENANT, JOB)] = (
            JobRecord(tenant=TENANT, job_id=JOB, request=request, state=state), 1)

    def state(self) -> JobState:
        return self.records[(TENANT, JOB)][0].state

    async def cached(self, tenant: str, job: str) -> JobRecord | None:
        found = self.records.get((tenant, job))
        return found[0] if found else None

    async def get(self, tenant: str, job: str) -> tuple[JobRecord, int]:
        return self.records[(tenant, job)]

    async def transition(self, tenant: str, job: str, to: JobState,
                         counters: JobCounters | None = None) -> bool:
        record, revision = self.records[(tenant, job)]
        if record.state is not JobState.RUNNING:
            return False
        self.log.append(f"transition {to}")
        changed = record.model_copy(update={"state": to, "counters": counters})
        self.records[(tenant, job)] = (changed, revision + 1)
        return True


class Counts:
    """The ledger's counters as the tracker reads them."""

    def __init__(self) -> None:
        self.value = JobCounters()

    def set(self, **counters: int | bool) -> None:
        self.value = JobCounters(**counters)

    async def __call__(self, tenant: str, job: str) -> JobCounters:
        return self.value


@pytest.fixture
def log() -> Log:
    return Log()


@pytest.fixture
def publisher(log: Log) -> FakePublisher:
    return FakePublisher(log)


@pytest.fixture
def jobs(log: Log) -> FakeJobs:
    store = FakeJobs(log)
    store.add()
    return store


@pytest.fixture
def counts() -> Counts:
    return Counts()


@pytest.fixture
def tracker(publisher: FakePublisher, jobs: FakeJobs, counts: Counts) -> CompletionTracker:
    return CompletionTracker(publisher, jobs, counts, progress_every=100)


async def test_not_complete_before_the_seeds_are_expanded(
    tracker: CompletionTracker, counts: Counts, publisher: FakePublisher, jobs: FakeJobs,
) -> None:
    counts.set(admitted=0, finished=0, seeded=False)
    assert await tracker.check(TENANT, JOB) is False
    counts.set(admitted=3, finished=3, seeded=False)  # seed pages finished, report not in yet
    assert await tracker.check(TENANT, JOB) is False
    assert publisher.sent == [] and jobs.state() is JobState.RUNNING


async def test_not_complete_while_an_admitted_page_is_unfinished(
    tracker: CompletionTracker, counts: Counts, publisher: FakePublisher, jobs: FakeJobs,
) -> None:
    counts.set(admitted=5, finished=4, failed=1, seeded=True)
    assert await tracker.check(TENANT, JOB) is False
    assert publisher.sent == [] and jobs.state() is JobState.RUNNING


async def test_complete_when_every_admitted_page_finished(
    tracker: CompletionTracker, counts: Counts, publisher: FakePublisher, jobs: FakeJobs,
) -> None:
    counts.set(admitted=5, finished=5, failed=1, seeded=True)
    assert await tracker.check(TENANT, JOB) is True
    (event,) = publisher.events()
    assert event.kind is JobEventKind.COMPLETED
    assert event.counters == JobCounters(admitted=5, finished=5, failed=1, seeded=True)
    assert [i for _, _, i in publisher.sent] == [COMPLETED_ID]
    record, _ = await jobs.get(TENANT, JOB)
    assert record.state is JobState.COMPLETED
    assert record.counters == event.counters


async def test_a_job_whose_seeds_admitted_nothing_completes(
    tracker: CompletionTracker, counts: Counts, jobs: FakeJobs,
) -> None:
    counts.set(admitted=0, finished=0, seeded=True)
    assert await tracker.check(TENANT, JOB) is True
    assert jobs.state() is JobState.COMPLETED


async def test_the_completed_event_is_published_before_the_job_transition(
    tracker: CompletionTracker, counts: Counts, log: Log,
) -> None:
    counts.set(admitted=2, finished=2, seeded=True)
    await tracker.check(TENANT, JOB)
    assert log == [f"publish {COMPLETED_ID}", f"transition {JobState.COMPLETED}"]


async def test_a_failed_event_publish_leaves_the_job_running_for_the_retry(
    tracker: CompletionTracker, counts: Counts, publisher: FakePublisher, jobs: FakeJobs,
) -> None:
    counts.set(admitted=2, finished=2, seeded=True)
    publisher.failures = 1
    with pytest.raises(RuntimeError):
        await tracker.check(TENANT, JOB)
    assert jobs.state() is JobState.RUNNING  # so a redelivery checks (and announces) again
    assert await tracker.check(TENANT, JOB) is True
    assert [e.kind for e in publisher.events()] == [JobEventKind.COMPLETED]
    assert jobs.state() is JobState.COMPLETED


async def test_a_second_check_after_completion_publishes_nothing(
    tracker: CompletionTracker, counts: Counts, publisher: FakePublisher, log: Log,
) -> None:
    counts.set(admitted=2, finished=2, seeded=True)
    assert await tracker.check(TENANT, JOB) is True
    assert await tracker.check(TENANT, JOB) is True
    assert len(publisher.sent) == 1
    assert log.count(f"transition {JobState.COMPLETED}") == 1


async def test_a_cancelled_job_is_never_completed(
    tracker: CompletionTracker, counts: Counts, publisher: FakePublisher, jobs: FakeJobs,
) -> None:
    jobs.add(JobState.CANCELLED)
    counts.set(admitted=2, finished=2, seeded=True)
    assert await tracker.check(TENANT, JOB) is False
    assert publisher.sent == [] and jobs.state() is JobState.CANCELLED


async def test_progress_every_n_finished_pages(
    publisher: FakePublisher, jobs: FakeJobs, counts: Counts,
) -> None:
    tracker = CompletionTracker(publisher, jobs, counts, progress_every=2)
    for finished in range(5):
        counts.set(admitted=10, finished=finished, seeded=True)
        assert await tracker.check(TENANT, JOB) is False
    progress = publisher.events()
    assert [e.kind for e in progress] == [JobEventKind.PROGRESS] * 2
    assert [e.counters.finished for e in progress] == [2, 4]
    assert [i for _, _, i in publisher.sent] == [
        subjects.msg_id(Stage.SINK, TENANT, JOB, "progress-2"),
        subjects.msg_id(Stage.SINK, TENANT, JOB, "progress-4"),
    ]


async def test_running_is_false_for_unknown_completed_and_cancelled_jobs(
    tracker: CompletionTracker, jobs: FakeJobs,
) -> None:
    assert await tracker.running(TENANT, JOB) is True
    assert await tracker.running(TENANT, "nosuchjob") is False
    for state in (JobState.COMPLETED, JobState.CANCELLED):
        jobs.add(state)
        assert await tracker.running(TENANT, JOB) is False
