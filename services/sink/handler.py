"""The sink: results into the tenant's RESULTS stream, page states, job completion.

Three inputs: parsed pages (a result each), dedup's expansion reports, and dead letters
(each a ``failed`` record for its job); and per tenant its parked results
(:mod:`services.sink.results`), retried until the tenant has room. Every input advances its page's state
(``services.sink.pages``); when a page becomes finished its ``finished`` ledger entry is
published and the job is checked for completion (``services.sink.completion``).

A parsed page of a *page replay* (``crawlmesh dlq replay`` of a page the sink already
finished as ``failed``: :mod:`shared.bus.replays`) is one additional result, marked
``replay_of``, stored under ``Nats-Msg-Id`` ``sink:<tenant>:<job>:<fingerprint>:replay<N>``
(once per replay, whatever the redeliveries) while its job is running or completed, never
parked (a full tenant is retried, then dead-lettered again). It changes no page state,
ledger entry or counter and announces nothing; a page replay that dies again is only a
dead letter again (no second ``failed`` record).
"""

from __future__ import annotations

import logging
from typing import Protocol

from services.sink.completion import CompletionTracker
from services.sink.pages import PageEvent, PageRecord, PageState, advance, delivered
from services.sink.results import Delivered
from shared import subjects
from shared.bus import replays
from shared.bus.loop import Delivery, Outbound
from shared.codec import DecodeError, decode
from shared.contracts import (
    DeadLetter,
    DiscoveredLinks,
    FetchedPage,
    FrontierEntry,
    JobState,
    LedgerEntry,
    Outcome,
    PageExpanded,
    PageResult,
    ParsedPage,
)
from shared.contracts.base import Contract
from shared.jobs import ledger_msg_id
from shared.subjects import LedgerKind, Stage
from shared.telemetry import metrics

log = logging.getLogger(__name__)

ROBOTS_PREFIX = "robots.txt disallows"
UNSUPPORTED_TYPES_OK = ("text/html", "application/xhtml+xml")


class Publisher(Protocol):
    """Publishes with a ``Nats-Msg-Id`` and waits for the PubAck (raises on failure).

    Returns False if the server reports a duplicate (``msg_id`` already stored), else True.
    """

    async def publish(self, subject: str, message: Contract, msg_id: str) -> bool: ...


class Results(Protocol):
    """Delivers a page's result to the tenant (:class:`services.sink.results.ResultsWriter`)."""

    async def write(self, tenant: str, job: str, fingerprint: str, result: PageResult, *,
                    park: bool = True) -> Delivered: ...


class PublishedResults:
    """Results straight through a :class:`Publisher` (no parking): for tests and tools."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    async def write(self, tenant: str, job: str, fingerprint: str, result: PageResult, *,
                    park: bool = True) -> Delivered:
        stored = await self.publisher.publish(
            subjects.results(tenant, job), result,
            subjects.msg_id(Stage.SINK, tenant, job, fingerprint))
        return Delivered.STORED if stored else Delivered.DUPLICATE


class PageStates(Protocol):
    async def get(self, tenant: str, job: str, fingerprint: str) -> PageRecord | None: ...

    async def set(self, tenant: str, job: str, fingerprint: str, record: PageRecord,
                  to: PageState, finished_by: str = "") -> bool: ...


def source_of(delivery: Delivery) -> str:
    """``<subject>#<stream sequence>``: the identity of an input message."""
    return f"{delivery.subject}#{delivery.stream_seq}"


def outcome_of(page: ParsedPage) -> Outcome:
    """Classify a page: robots disallow, fetch error, HTTP error, unsupported type, ok."""
    if page.error and page.error.startswith(ROBOTS_PREFIX):
        return Outcome.ROBOTS_DISALLOWED
    if page.error and page.status == 0:
        return Outcome.FETCH_ERROR
    if page.status >= 400:
        return Outcome.HTTP_ERROR
    content_type = (page.content_type or "").split(";")[0].strip().lower()
    if page.status < 300 and content_type not in UNSUPPORTED_TYPES_OK:
        return Outcome.UNSUPPORTED
    if page.error:
        return Outcome.FETCH_ERROR
    return Outcome.OK


def result_of(page: ParsedPage) -> PageResult:
    return PageResult(
        tenant=page.tenant, job_id=page.job_id, url=page.url, final_url=page.final_url,
        fingerprint=page.fingerprint, outcome=outcome_of(page), status=page.status or None,
        content_type=page.content_type, depth=page.depth, title=page.title,
        description=page.description, canonical_url=page.canonical_url,
        fetched_at=page.fetched_at, extracted=dict(page.extracted), error=page.error,
    )


class PageLedger:
    """Applies page events: CAS the state, publish the result / ledger entries, check."""

    def __init__(self, publisher: Publisher, pages: PageStates,
                 completion: CompletionTracker, results: Results | None = None) -> None:
        self.publisher = publisher
        self.pages = pages
        self.completion = completion
        self.results = results or PublishedResults(publisher)

    async def apply(self, tenant: str, job: str, fingerprint: str, event: PageEvent,
                    result: PageResult | None = None, source: str = "",
                    park: bool = True) -> None:
        """Advance one page by ``event``; deliver ``result`` first if not yet delivered.

        A result the server stores (not a duplicate of an earlier try) counts once in
        ``crawlmesh_results_stored_total``. A result the tenant has no room for is parked
        (``park``) and the page stays as it is: it is not finished until the result is
        stored (from the parked loop, ``park=False``: raises
        :class:`~services.sink.results.TenantFullError` while there is still no room).

        ``source`` identifies the input message (``<subject>#<stream sequence>``); the one
        that finishes the page is recorded, so only its redelivery republishes the page's
        ledger entries.
        """
        finisher = f"{event}@{source}"
        for _ in range(50):
            record = await self.pages.get(tenant, job, fingerprint)
            if record is None:
                log.info("no page state for %s/%s/%s: job purged?", tenant, job, fingerprint)
                return
            if result is not None and not delivered(record.state):
                delivery = await self.results.write(tenant, job, fingerprint, result, park=park)
                if delivery is Delivered.PARKED:
                    return  # finished once the parked result is stored
                if delivery is Delivered.STORED:  # the one delivery of this page's result
                    metrics.RESULTS_STORED.labels(tenant, str(result.outcome)).inc()
            to = advance(record.state, event)
            if to is None:
                if record.state is PageState.FINISHED and record.finished_by == finisher:
                    await self._finished(tenant, job, fingerprint, event)  # redelivery
                return
            by = finisher if to is PageState.FINISHED else ""
            if not await self.pages.set(tenant, job, fingerprint, record, to, by):
                continue
            if to is PageState.FINISHED:
                await self._finished(tenant, job, fingerprint, event)
            return
        raise RuntimeError(f"page state of {fingerprint} kept changing")

    async def _finished(self, tenant: str, job: str, fingerprint: str, event: PageEvent) -> None:
        if event is PageEvent.FAILED:
            await self.publisher.publish(
                subjects.ledger(tenant, job, LedgerKind.FAILED),
                LedgerEntry(tenant=tenant, job_id=job, kind="failed", fingerprint=fingerprint),
                ledger_msg_id(tenant, job, LedgerKind.FAILED, fingerprint),
            )
        await self.publisher.publish(
            subjects.ledger(tenant, job, LedgerKind.FINISHED),
            LedgerEntry(tenant=tenant, job_id=job, kind="finished", fingerprint=fingerprint),
            ledger_msg_id(tenant, job, LedgerKind.FINISHED, fingerprint),
        )
        await self.completion.check(tenant, job)

    async def seeded(self, tenant: str, job: str) -> None:
        await self.publisher.publish(
            subjects.ledger(tenant, job, LedgerKind.SEEDED),
            LedgerEntry(tenant=tenant, job_id=job, kind="seeded"),
            ledger_msg_id(tenant, job, LedgerKind.SEEDED, "seeds"),
        )
        await self.completion.check(tenant, job)


class ResultHandler:
    """Parsed page -> one result for the tenant (once per page)."""

    def __init__(self, ledger: PageLedger) -> None:
        self.ledger = ledger

    async def handle(self, message: ParsedPage, delivery: Delivery) -> list[Outbound]:
        replay = replays.of(delivery.headers)
        if replay is not None and replay.page:
            await self.replayed(message, replay)
            return []
        if not await self.ledger.completion.running(message.tenant, message.job_id):
            return []
        await self.ledger.apply(message.tenant, message.job_id, message.fingerprint,
                                PageEvent.RESULT, result_of(message), source_of(delivery))
        return []

    async def replayed(self, message: ParsedPage, replay: replays.Replay) -> None:
        """Store the result of a page replay as one more record (module docstring).

        Raises:
            TenantFullError: the tenant has no room (retried; never parked).
            TransientError: no answer from JetStream.
        """
        await store_replay(self.ledger, result_of(message), replay)


async def store_replay(ledger: PageLedger, result: PageResult, replay: replays.Replay) -> None:
    """Store ``result`` of a page replay as one more record for its URL, marked
    ``replay_of``, once per replay generation; dropped for a cancelled or unknown job.

    Raises:
        TenantFullError: the tenant has no room (retried; never parked).
        TransientError: no answer from JetStream.
    """
    tenant, job, fp = result.tenant, result.job_id, result.fingerprint
    record = await ledger.completion.jobs.cached(tenant, job)
    if record is None or record.state is JobState.CANCELLED:
        log.info("replay %s of %s dropped: job %s is %s", replay.of, result.url, job,
                 "unknown" if record is None else record.state)
        return
    result = result.model_copy(update={"replay_of": replay.of})
    delivery = await ledger.results.write(
        tenant, job, f"{fp}:replay{replay.generation}", result, park=False)
    if delivery is Delivered.STORED:
        metrics.RESULTS_STORED.labels(tenant, str(result.outcome)).inc()


class ExpansionHandler:
    """Dedup's report that a page's outlinks were admitted or rejected."""

    def __init__(self, ledger: PageLedger) -> None:
        self.ledger = ledger

    async def handle(self, message: PageExpanded, delivery: Delivery) -> list[Outbound]:
        if not await self.ledger.completion.running(message.tenant, message.job_id):
            return []
        if message.fingerprint is None:
            await self.ledger.seeded(message.tenant, message.job_id)
        else:
            await self.ledger.apply(message.tenant, message.job_id, message.fingerprint,
                                    PageEvent.EXPANDED, source=source_of(delivery))
        return []


class ParkedHandler:
    """The head parked result of one tenant: stored now (the page advances as if it had
    just arrived), or :class:`~services.sink.results.TenantFullError` (nak, tried again in
    ``PARKED_RETRY_S``). Once the tenant's parked backlog is empty its pause is lifted."""

    def __init__(self, ledger: PageLedger, pauses: Pauses) -> None:
        self.ledger = ledger
        self.pauses = pauses

    async def handle(self, message: PageResult, delivery: Delivery) -> list[Outbound]:
        tenant, job = message.tenant, message.job_id
        replay = replays.of(delivery.headers)
        if replay is not None and replay.page:  # a dead-lettered parked result, replayed
            await store_replay(self.ledger, message, replay)
        elif await self.ledger.completion.running(tenant, job):
            event = PageEvent.FAILED if message.outcome is Outcome.FAILED else PageEvent.RESULT
            await self.ledger.apply(tenant, job, message.fingerprint, event, message,
                                    source_of(delivery), park=False)
        await self.pauses.clear_if_drained(tenant, in_flight=1)
        return []


class Pauses(Protocol):
    async def clear_if_drained(self, tenant: str, in_flight: int = 0) -> bool: ...


_PAGE_MODELS: dict[str, type[FrontierEntry | FetchedPage | ParsedPage | PageResult]] = {
    "FRONTIER": FrontierEntry, "FETCHED": FetchedPage, "PARSED": ParsedPage,
    "PARKED": PageResult,  # a parked result the sink could not store: its page fails too
}


class DeadLetterHandler:
    """Each dead letter of a page becomes a ``failed`` result, finishing the page."""

    def __init__(self, ledger: PageLedger) -> None:
        self.ledger = ledger

    async def handle(self, message: DeadLetter, delivery: Delivery) -> list[Outbound]:
        tenant, job = message.tenant, message.job_id
        if job == subjects.NO_JOB or not await self.ledger.completion.running(tenant, job):
            return []
        replay = replays.of(message.headers)
        if replay is not None and replay.page:  # its page was finished by the first one
            log.info("dead letter %s is replay %s of %s: nothing more to fail", message.id,
                     replay.generation, replay.of)
            return []
        try:
            if message.stream in _PAGE_MODELS:
                page = decode(message.original, _PAGE_MODELS[message.stream])
                result = PageResult(
                    tenant=tenant, job_id=job, url=page.url, fingerprint=page.fingerprint,
                    outcome=Outcome.FAILED, depth=page.depth,
                    error=f"dead-lettered by {message.stage}: {message.reason}",
                )
                await self.ledger.apply(tenant, job, page.fingerprint, PageEvent.FAILED, result,
                                        source_of(delivery))
            elif message.stream in ("LINKS", "EXPANDED"):
                model = DiscoveredLinks if message.stream == "LINKS" else PageExpanded
                links = decode(message.original, model)
                source = (links.source_fingerprint if isinstance(links, DiscoveredLinks)
                          else links.fingerprint)
                if source is None:
                    await self.ledger.seeded(tenant, job)
                else:
                    await self.ledger.apply(tenant, job, source, PageEvent.EXPANDED,
                                            source=source_of(delivery))
            else:
                log.warning("dead letter %s from %s: no page to fail", message.id, message.stream)
        except DecodeError as error:
            log.warning("dead letter %s holds no decodable page (%s)", message.id, error)
        return []
