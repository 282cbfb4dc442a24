"""The dedup handler: discovered links in; frontier entries, ledger entries and one
expansion report out.

For each link: canonicalise (``shared.urls``), check the job's scope, depth and URL length
(``services.dedup.scope``), then admit once per job (``services.dedup.admission``). Every
admitted URL gets a frontier entry on its host's partition and an ``admitted`` ledger
entry; only after those are acknowledged is the :class:`PageExpanded` report published
(phase 1), so the sink never sees a page expanded before its children are counted.
Each frontier entry starts the admitted page's own trace (``Outbound.new_trace``).

Each link of a running job counts once in ``crawlmesh_dedup_links_total`` by decision:
``invalid`` (no canonical form, or too long), ``duplicate`` (repeated in the message),
``out_of_scope``, ``too_deep`` and ``admitted`` here; the admission counts the links it
refuses (``duplicate``, ``over_budget``).

A running job's links are not admitted while its tenant is held (suspended, or paused
because its results are parked: :mod:`shared.tenantgate`): the message is held a few
seconds and, if the tenant is still held, re-published to its subject under a new
``Nats-Msg-Id`` (``<original id>:held-<stream seq>``) and acked — never nak'd, which would
count towards ``max_deliver``. Held messages wait outside the ``work_slots`` that bound
real admission work, so a held tenant does not take every slot from the others.

The outlinks of a page replay (``crawlmesh dlq replay`` of a page that the sink already
finished as ``failed``: :mod:`shared.bus.replays`) are not followed: the page was already
counted as finished, so its links cannot join the job's completion accounting (and the job
may have completed since). They are acked with no output. A replayed ``LINKS`` dead letter
is admitted as usual.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from typing import Protocol

from services.dedup.admission import Candidate
from services.dedup.scope import TOO_LONG, JobScope
from shared import subjects
from shared.bus import replays
from shared.bus.loop import Delivery, Outbound
from shared.bus.outcomes import UnprocessableError
from shared.contracts import (
    CrawlRequest,
    DiscoveredLinks,
    FrontierEntry,
    JobRecord,
    JobState,
    LedgerEntry,
    PageExpanded,
)
from shared.jobs import ledger_msg_id
from shared.subjects import LedgerKind, Stage
from shared.telemetry import metrics
from shared.urls import UrlError, canonical_url, fingerprint, host_of


class Admission(Protocol):
    async def admit(
        self, tenant: str, job: str, candidates: list[Candidate], cause: str,
        max_pages: int, max_pages_per_host: int,
    ) -> list[Candidate]: ...


class JobSource(Protocol):
    async def cached(self, tenant: str, job: str) -> JobRecord | None: ...


class TenantHolds(Protocol):
    async def wait_released(self, tenant: str, hold_s: float = ...) -> str | None: ...


def held_msg_id(delivery: Delivery) -> str:
    """``<original Nats-Msg-Id>:held-<stream seq>``: unique per held copy, the same for a
    redelivery of that copy (so it is re-published once)."""
    original = delivery.headers.get("Nats-Msg-Id") or f"links-{delivery.subject}"
    return f"{original.split(':held-')[0]}:held-{delivery.stream_seq}"


INLINE_LINKS = 200
"""Messages with more links are screened in a worker thread (:func:`screen`)."""


def screen(message: DiscoveredLinks, scope: JobScope
           ) -> tuple[list[Candidate], dict[str, str], Counter[str]]:
    """Canonicalise, de-duplicate and scope-check the links of ``message``.

    CPU-bound (about 0.1-0.2 ms a link here): a page's 10,000 links (the parser's
    ``max_links``) take 1-2 s, longer than a consumer's ack wait, so large messages run in
    a worker thread and the event loop keeps sending the ``in_progress`` heartbeat (run on
    the loop, such a message was redelivered and dead-lettered, its links lost).

    Returns:
        The candidates in link order, ``{fingerprint: canonical URL}`` and the count of
        each refusal (``invalid``, ``duplicate``, ``out_of_scope``).
    """
    candidates: list[Candidate] = []
    urls: dict[str, str] = {}
    decisions: Counter[str] = Counter()
    for link in message.links:
        try:
            url = canonical_url(link.url)
        except UrlError:
            decisions["invalid"] += 1
            continue
        fp = fingerprint(url)
        if fp in urls:
            decisions["duplicate"] += 1
            continue
        if (reason := scope.check(url)) is not None:
            decisions["invalid" if reason == TOO_LONG else "out_of_scope"] += 1
            continue
        urls[fp] = url
        candidates.append(Candidate(fp, host_of(url)))
    return candidates, urls, decisions


class DedupHandler:
    """Admits each canonical URL once per job (see module docstring)."""

    def __init__(self, admission: Admission, jobs: JobSource, max_scopes: int = 1000,
                 holds: TenantHolds | None = None, hold_s: float = 3.0,
                 work_slots: int | None = None) -> None:
        self.admission = admission
        self.jobs = jobs
        self.max_scopes = max_scopes
        self.holds = holds
        self.hold_s = hold_s
        self._work = asyncio.Semaphore(work_slots) if work_slots else None
        self._scopes: OrderedDict[tuple[str, str], JobScope] = OrderedDict()

    def scope(self, tenant: str, job: str, request: CrawlRequest) -> JobScope:
        key = (tenant, job)
        found = self._scopes.get(key)
        if found is None:
            found = self._scopes[key] = JobScope(request)
            while len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
        return found

    async def handle(self, message: DiscoveredLinks, delivery: Delivery) -> list[Outbound]:
        """Raises:
        UnprocessableError: the job does not exist (dead-lettered with that reason).
        """
        tenant, job = message.tenant, message.job_id
        replay = replays.of(delivery.headers)
        if replay is not None and replay.page:  # see the module docstring
            return []
        record = await self.jobs.cached(tenant, job)
        if record is None:
            raise UnprocessableError(f"unknown job {job!r} of tenant {tenant}")
        if record.state is JobState.RUNNING and self.holds is not None:
            if await self.holds.wait_released(tenant, self.hold_s) is not None:
                return [Outbound(subjects.links(tenant, job), message, held_msg_id(delivery))]
        if self._work is None:
            return await self._admit(message, record)
        async with self._work:
            return await self._admit(message, record)

    async def _admit(self, message: DiscoveredLinks, record: JobRecord) -> list[Outbound]:
        tenant, job = message.tenant, message.job_id
        source = message.source_fingerprint or "seeds"
        cause = subjects.msg_id(Stage.DEDUP, tenant, job, f"from-{source}-{message.part}")
        candidates: list[Candidate] = []
        urls: dict[str, str] = {}
        request = record.request
        decisions: Counter[str] = Counter()
        if record.state is JobState.RUNNING and message.depth > request.max_depth:
            decisions["too_deep"] += len(message.links)
        elif record.state is JobState.RUNNING:
            scope = self.scope(tenant, job, request)
            if len(message.links) > INLINE_LINKS:  # see :func:`screen`
                candidates, urls, decisions = await asyncio.to_thread(screen, message, scope)
            else:
                candidates, urls, decisions = screen(message, scope)
        admitted = await self.admission.admit(
            tenant, job, candidates, cause, request.max_pages, request.max_pages_per_host
        )
        decisions["admitted"] += len(admitted)
        for decision, count in decisions.items():
            if count:
                metrics.DEDUP_LINKS.labels(tenant, decision).inc(count)
        outputs: list[Outbound] = []
        for cand in admitted:
            entry = FrontierEntry(
                tenant=tenant, job_id=job, url=urls[cand.fingerprint],
                fingerprint=cand.fingerprint, host=cand.host, depth=message.depth,
                redirects=message.redirects,
            )
            outputs.append(Outbound(
                subjects.frontier(subjects.partition_of(cand.host), tenant, job), entry,
                subjects.msg_id(Stage.DEDUP, tenant, job, cand.fingerprint),
                new_trace=True,  # one trace per page, linked to the discovering page's
            ))
            outputs.append(Outbound(
                subjects.ledger(tenant, job, LedgerKind.ADMITTED),
                LedgerEntry(tenant=tenant, job_id=job, kind="admitted",
                            fingerprint=cand.fingerprint),
                ledger_msg_id(tenant, job, LedgerKind.ADMITTED, cand.fingerprint),
            ))
        report = PageExpanded(
            tenant=tenant, job_id=job, fingerprint=message.source_fingerprint,
            links_seen=len(message.links), admitted=len(admitted),
            admitted_fingerprints=tuple(c.fingerprint for c in admitted),
        )
        outputs.append(Outbound(subjects.expanded(tenant, job), report, cause, phase=1))
        return outputs
