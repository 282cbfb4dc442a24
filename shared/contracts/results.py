"""What tenants read: one result per page, job events, and dead letters for operators."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from shared.contracts.base import Contract, Token, UtcDatetime, utc_now
from shared.contracts.requests import JobCounters


class Outcome(StrEnum):
    OK = "ok"
    HTTP_ERROR = "http_error"
    ROBOTS_DISALLOWED = "robots_disallowed"
    UNSUPPORTED = "unsupported"
    FETCH_ERROR = "fetch_error"
    FAILED = "failed"  # dead-lettered: the mesh could not process it


class PageResult(Contract):
    """One result per page, in the tenant's ``RESULTS`` stream (``crawl.results.<job>``)."""

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    url: str
    final_url: str | None = None
    fingerprint: str
    outcome: Outcome
    status: int | None = None
    content_type: str | None = None
    depth: int = Field(ge=0)
    title: str | None = None
    description: str | None = None
    canonical_url: str | None = None
    fetched_at: UtcDatetime | None = None
    extracted: dict[str, str | list[str] | None] = Field(default_factory=dict)
    error: str | None = None
    replay_of: str | None = Field(
        None, description=(
            "Set on the extra result of a dead letter replayed by an operator "
            "(`crawlmesh dlq replay`): the dead letter's id. The page's first result (often "
            "`failed`) stays; each replay adds one record."))


class JobEventKind(StrEnum):
    STARTED = "started"
    PROGRESS = "progress"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


class JobEvent(Contract):
    """A job lifecycle event, in the tenant's ``EVENTS`` stream (``crawl.events.<job>``)."""

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    kind: JobEventKind
    at: UtcDatetime = Field(default_factory=utc_now)
    counters: JobCounters = JobCounters()
    reason: str | None = None


class DeadLetter(Contract):
    """A message the mesh could not process (``mesh.dlq.<stage>.<tenant>.<job>``).

    Keeps the original payload (out of band, ``BINARY_FIELD``) and headers so it can be
    inspected and replayed. ``id`` is ``<stream>:<sequence>`` of the original message; the
    dead letter's ``Nats-Msg-Id`` is ``dlq:<id>``, so two paths never double it.
    """

    BINARY_FIELD: ClassVar[str | None] = "original"
    schema_version: Literal[1] = 1
    id: str
    tenant: Token
    job_id: Token
    stage: str
    reason: str
    delivery_count: int = Field(ge=0)
    subject: str
    stream: str
    stream_seq: int = Field(ge=0)
    headers: dict[str, str] = Field(default_factory=dict)
    dead_at: UtcDatetime = Field(default_factory=utc_now)
    original: bytes = b""
