"""The sink handlers: parsed pages and dead letters in; tenant results out."""

from __future__ import annotations

from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.contracts import DeadLetter, Outcome, PageExpanded, PageResult, ParsedPage
from shared.subjects import Stage


def outcome_of(page: ParsedPage) -> Outcome:
    """Classify a parsed page: ok, HTTP error, or a fetch error."""
    if page.error:
        return Outcome.FETCH_ERROR
    if page.status >= 400:
        return Outcome.HTTP_ERROR
    return Outcome.OK


class SinkHandler:
    """One result per parsed page into the tenant's RESULTS stream."""

    async def handle(self, message: ParsedPage, delivery: Delivery) -> list[Outbound]:
        result = PageResult(
            tenant=message.tenant, job_id=message.job_id, url=message.url,
            final_url=message.final_url, fingerprint=message.fingerprint,
            outcome=outcome_of(message), status=message.status,
            content_type=message.content_type, depth=message.depth, title=message.title,
            fetched_at=message.fetched_at, extracted=dict(message.extracted),
            error=message.error,
        )
        return [Outbound(
            subjects.results(message.tenant, message.job_id), result,
            subjects.msg_id(Stage.SINK, message.tenant, message.job_id, message.fingerprint),
        )]


class ExpansionHandler:
    """Expansion reports (completion accounting comes with the job tracker)."""

    async def handle(self, message: PageExpanded, delivery: Delivery) -> list[Outbound]:
        return []


class DeadLetterHandler:
    """Each dead letter becomes a ``failed`` record for its job."""

    async def handle(self, message: DeadLetter, delivery: Delivery) -> list[Outbound]:
        if message.job_id == subjects.NO_JOB or message.tenant == "unknown":
            return []
        result = PageResult(
            tenant=message.tenant, job_id=message.job_id, url=message.subject,
            fingerprint=f"dlq-{message.id}", outcome=Outcome.FAILED, depth=0,
            error=f"dead-lettered by {message.stage}: {message.reason}",
        )
        return [Outbound(
            subjects.results(message.tenant, message.job_id), result,
            subjects.msg_id(Stage.SINK, message.tenant, message.job_id, f"dlq-{message.id}"),
        )]
