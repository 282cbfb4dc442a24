"""The seeder's handler: submission in; job record, ``started`` event and seed links out."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import orjson

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
    SeedReply,
)
from shared.subjects import Stage


class JobStore(Protocol):
    """Where job records live (the ``jobs`` KV bucket in production)."""

    async def create(self, record: JobRecord) -> JobRecord:
        """Store ``record`` unless the job exists; return the stored record either way."""
        ...


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
    """Validates a submission and starts its job (see module docstring)."""

    def __init__(self, jobs: JobStore) -> None:
        self.jobs = jobs

    async def handle(self, message: RawSubmission, delivery: Delivery) -> list[Outbound]:
        tenant = delivery.tenant
        try:
            request = parse_submission(message.data)
        except SubmissionError as error:
            return self._reject(tenant, job_id_for(delivery), str(error), message.data)
        job = request.job_id or job_id_for(delivery)
        record = await self.jobs.create(JobRecord(tenant=tenant, job_id=job, request=request))
        if record.request != request:
            return self._reject(tenant, job, f"job id {job!r} is already in use", message.data)
        outputs = [
            Outbound(
                subjects.events(tenant, job),
                JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.STARTED),
                subjects.msg_id(Stage.SEEDER, tenant, job, "started"),
            ),
            Outbound(
                subjects.links(tenant, job),
                DiscoveredLinks(
                    tenant=tenant, job_id=job, origin=LinkOrigin.SEED, depth=0,
                    links=tuple(Link(url=seed) for seed in request.seeds),
                ),
                subjects.msg_id(Stage.SEEDER, tenant, job, "seeds"),
            ),
        ]
        if request.reply_to:
            reply = SeedReply(tenant=tenant, accepted=True, job_id=job)
            outputs.append(Outbound(request.reply_to, reply, "", core=True))
        return outputs

    def _reject(self, tenant: str, job: str, reason: str, data: bytes) -> list[Outbound]:
        outputs = [
            Outbound(
                subjects.events(tenant, job),
                JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.REJECTED, reason=reason),
                subjects.msg_id(Stage.SEEDER, tenant, job, "rejected"),
            )
        ]
        reply_to = _reply_to_of(data)
        if reply_to:
            reply = SeedReply(tenant=tenant, accepted=False, job_id=None, reason=reason)
            outputs.append(Outbound(reply_to, reply, "", core=True))
        return outputs


def _reply_to_of(data: bytes) -> str | None:
    """Best-effort ``reply_to`` of an invalid JSON request, so the rejection still reaches it."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    reply = value.get("reply_to") if isinstance(value, dict) else None
    if isinstance(reply, str) and re.fullmatch(r"_INBOX\.[A-Za-z0-9_.-]{1,250}", reply):
        return reply
    return None


__all__ = ["CrawlRequest", "RawSubmission", "SeederHandler", "job_id_for"]
