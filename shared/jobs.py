"""Job records (KV bucket ``jobs``, key ``<tenant>.<job>``) and the completion ledger.

The job record holds the request and the state (running -> completed | cancelled); state
changes are compare-and-set on the KV revision, so exactly one process makes each change.

The ledger (stream ``LEDGER``, subjects ``mesh.ledger.<tenant>.<job>.<kind>``) holds one
empty message per page per kind, published with a ``Nats-Msg-Id`` per page, so a
redelivery never counts twice; the per-subject message counts the server keeps are the
job's counters (:func:`ledger_counts`), read in one request whatever the job's size.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from shared import subjects
from shared.bus.kvkeys import kv_keys, live_entries
from shared.codec import decode, encode
from shared.contracts import JobCounters, JobRecord, JobState
from shared.streams import JOBS_BUCKET, LEDGER
from shared.subjects import LedgerKind


class JobNotFoundError(LookupError):
    """No record for this tenant and job."""


def job_key(tenant: str, job: str) -> str:
    return f"{tenant}.{job}"


class JobStore:
    """Reads and changes job records; ``cached`` reads are at most ``ttl_s`` seconds old."""

    def __init__(self, js: JetStreamContext, ttl_s: float = 2.0) -> None:
        self.js = js
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[float, JobRecord]] = {}

    async def _kv(self):  # type: ignore[no-untyped-def]
        return await self.js.key_value(JOBS_BUCKET)

    async def create(self, record: JobRecord) -> JobRecord:
        """Store ``record`` unless the job exists; return the stored record either way."""
        kv = await self._kv()
        key = job_key(record.tenant, record.job_id)
        try:
            await kv.create(key, encode(record))
            return record
        except KeyWrongLastSequenceError:
            entry = await kv.get(key)
            return decode(entry.value or b"", JobRecord)

    async def get(self, tenant: str, job: str) -> tuple[JobRecord, int]:
        """The record and its KV revision.

        Raises:
            JobNotFoundError: no such job.
        """
        kv = await self._kv()
        try:
            entry = await kv.get(job_key(tenant, job))
        except KeyNotFoundError:
            raise JobNotFoundError(f"no job {job!r} for tenant {tenant}", job) from None
        record = decode(entry.value or b"", JobRecord)
        self._cache[job_key(tenant, job)] = (time.monotonic(), record)
        return record, entry.revision or 0

    async def cached(self, tenant: str, job: str) -> JobRecord | None:
        """The record as of at most ``ttl_s`` seconds ago, or None if there is no such job."""
        hit = self._cache.get(job_key(tenant, job))
        if hit and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        try:
            return (await self.get(tenant, job))[0]
        except JobNotFoundError:
            return None

    async def transition(
        self, tenant: str, job: str, to: JobState, counters: JobCounters | None = None
    ) -> bool:
        """Move a running job to ``to`` by compare-and-set. True if this call made the change.

        Raises:
            JobNotFoundError: no such job.
        """
        kv = await self._kv()
        for _ in range(20):
            record, revision = await self.get(tenant, job)
            if record.state is not JobState.RUNNING:
                return False
            changed = record.model_copy(
                update={"state": to, "finished_at": datetime.now(UTC), "counters": counters}
            )
            try:
                await kv.update(job_key(tenant, job), encode(changed), last=revision)
            except KeyWrongLastSequenceError:
                continue
            self._cache[job_key(tenant, job)] = (time.monotonic(), changed)
            return True
        return False

    async def all(self, tenant: str | None = None) -> list[JobRecord]:
        """Every job record (of ``tenant`` when given), oldest first (read fresh)."""
        values = await live_entries(self.js, await self._kv(), JOBS_BUCKET,
                                    f"{tenant}.*" if tenant else ">")
        records = [decode(value, JobRecord) for value in values.values()]
        return sorted(records, key=lambda r: r.created_at)

    async def running_count(self, tenant: str) -> int:
        """How many jobs of ``tenant`` are running now (read fresh)."""
        return sum(record.state is JobState.RUNNING for record in await self.all(tenant))

    async def cancel_all(self, tenant: str, reason: str = "") -> list[str]:
        """Cancel every running job of ``tenant``; the ids of those this call cancelled."""
        cancelled = []
        for record in await self.all(tenant):
            if record.state is JobState.RUNNING and await self.transition(
                tenant, record.job_id, JobState.CANCELLED
            ):
                cancelled.append(record.job_id)
        return cancelled

    async def delete_all(self, tenant: str) -> None:
        """Remove every job record of ``tenant`` (tenant removal)."""
        kv = await self._kv()
        for key in await kv_keys(self.js, JOBS_BUCKET, f"{tenant}.*"):
            await kv.purge(key)
            self._cache.pop(key, None)


async def ledger_counts(js: JetStreamContext, tenant: str, job: str) -> JobCounters:
    """The job's counters from the ledger's per-subject message counts (one request)."""
    prefix = f"mesh.ledger.{tenant}.{job}"
    try:
        info = await js.stream_info(LEDGER.name, subjects_filter=f"{prefix}.*")
    except NotFoundError:
        return JobCounters()
    counts = {subject.rsplit(".", 1)[1]: n for subject, n in (info.state.subjects or {}).items()}
    return JobCounters(
        admitted=counts.get(LedgerKind.ADMITTED, 0),
        finished=counts.get(LedgerKind.FINISHED, 0),
        failed=counts.get(LedgerKind.FAILED, 0),
        seeded=counts.get(LedgerKind.SEEDED, 0) > 0,
    )


def ledger_msg_id(tenant: str, job: str, kind: LedgerKind, fingerprint: str) -> str:
    """``ledger:<tenant>:<job>:<kind>-<fingerprint>``: one ledger entry per page and kind."""
    return subjects.msg_id("ledger", tenant, job, f"{kind}-{fingerprint}")
