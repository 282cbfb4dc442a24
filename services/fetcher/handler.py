"""The fetcher handler: a frontier entry in; a fetched page, or the entry re-published later.

For each entry: robots.txt of its origin (:mod:`~services.fetcher.robots`) -> a disallowed
URL is reported, never requested; its host's queue (:mod:`~services.fetcher.politeness`)
-> if its turn is further away than ``queue_horizon_s`` the entry is re-published to its
frontier subject with ``not_before`` and ``generation + 1`` (never ``nak(delay)``, which
would count towards ``max_deliver``); otherwise it waits for its turn and is fetched
(:mod:`~services.fetcher.downloader`), redirects followed by hand so every hop passes
robots.txt, politeness and the egress policy (:mod:`~services.fetcher.egress`).

Outcomes: every HTTP answer is a :class:`FetchedPage` (a result, not a dead letter).
Retryable statuses and network errors raise :class:`TransientError` while
``delivery.delivered <= http_retries``; after that they are reported too. Refusals carry
``status`` 0 and an ``error`` starting with :data:`ROBOTS_DISALLOWS` or
:data:`EGRESS_REFUSES`. Only HTML-ish bodies are downloaded; they travel zlib-compressed,
inline or, above ``body_inline_max_bytes``, through a :class:`BodyStore`
(:mod:`~services.fetcher.bodies`).

Metrics (:mod:`shared.telemetry.metrics`): robots.txt decisions (a URL counts as
disallowed when refused, as allowed when requested, so a re-published entry counts once);
each re-published entry (``crawlmesh_politeness_deferred_total``); each request's wait
for its host's turn, seconds (the first hop's includes the time an entry slept for its
scheduled slot); and per fetch that got an answer or failed, its duration over all hops,
seconds, and its decompressed body size, bytes, by status class (``error``: no answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Literal
from urllib.parse import urljoin

import httpcore

from services.fetcher.bodies import BodyStore, pack_body
from services.fetcher.downloader import (
    REDIRECT_STATUSES,
    Downloader,
    FetchError,
    HttpResponse,
    build_client,
)
from services.fetcher.egress import EgressPolicy, EgressRefusedError
from services.fetcher.politeness import HostPoliteness
from services.fetcher.retry import retry_after_s
from services.fetcher.robots import RobotsCache, RobotsRules, RobotsStore
from services.fetcher.settings import FetcherSettings
from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.bus.outcomes import TransientError
from shared.contracts import FetchedPage, FrontierEntry, utc_now
from shared.subjects import Stage
from shared.telemetry import metrics
from shared.telemetry.metrics import status_class
from shared.urls import UrlError, canonical_url, host_of

ROBOTS_DISALLOWS = "robots.txt disallows"
"""Prefix of the error of a URL robots.txt disallows (the sink's ``robots_disallowed``)."""

EGRESS_REFUSES = "egress policy refuses"
"""Prefix of the error of a URL whose address the egress policy refuses."""

FRONTIER_ID_STAGE = "frontier"
"""Stage token of the ids of re-published frontier entries (``frontier:t:j:fp:gen``)."""


class _Refused(Exception):
    """A hop that must not be requested: robots.txt or the egress policy said no."""


BeforeFetch = Literal["drop", "hold"] | None
"""What :attr:`FetcherHandler.before_fetch` decides for an entry whose turn has come."""


class FetcherHandler:
    """Fetches frontier entries politely (see module docstring).

    Args:
        settings: the fetcher's settings.
        downloader: single-hop GETs.
        robots: robots.txt rules per origin.
        politeness: per-host queues and delays.
        bodies: store for bodies above ``body_inline_max_bytes`` (compressed size).
        body_inline_max_bytes: from ``MeshSettings``.
        http_retries: retries of a retryable outcome; keep it below ``max_deliver``.
    """

    def __init__(self, settings: FetcherSettings, *, downloader: Downloader, robots: RobotsCache,
                 politeness: HostPoliteness, bodies: BodyStore, body_inline_max_bytes: int,
                 http_retries: int) -> None:
        self.settings = settings
        self.downloader = downloader
        self.robots = robots
        self.politeness = politeness
        self.bodies = bodies
        self.body_inline_max_bytes = body_inline_max_bytes
        self.http_retries = http_retries
        self.before_fetch: Callable[[FrontierEntry], Awaitable[BeforeFetch]] | None = None
        """Asked once an entry's turn has come, just before its request: an entry may wait
        for its host's turn for up to ``queue_horizon_s`` seconds, and its job may be
        cancelled or its tenant suspended meanwhile (``"drop"``: nothing is fetched;
        ``"hold"``: re-published under the next generation; None: fetch)."""

    @classmethod
    def build(cls, settings: FetcherSettings, *, robots_store: RobotsStore, bodies: BodyStore,
              body_inline_max_bytes: int, http_retries: int | None = None,
              network_backend: httpcore.AsyncNetworkBackend | None = None) -> FetcherHandler:
        """Assemble a handler and its HTTP client from settings (``network_backend``: see
        :func:`~services.fetcher.downloader.build_client`)."""
        client = build_client(settings, EgressPolicy(settings.egress_allow), network_backend)
        downloader = Downloader(client, settings.total_timeout_s)
        return cls(
            settings, downloader=downloader,
            robots=RobotsCache(downloader, robots_store, settings),
            politeness=HostPoliteness(settings.default_delay_s, settings.host_delays,
                                      settings.crawl_delay_max_s),
            bodies=bodies, body_inline_max_bytes=body_inline_max_bytes,
            http_retries=settings.http_retries if http_retries is None else http_retries,
        )

    async def aclose(self) -> None:
        """Close the HTTP client and cancel robots.txt lookups in progress."""
        await self.robots.aclose()
        await self.downloader.client.aclose()

    async def handle(self, message: FrontierEntry, delivery: Delivery) -> list[Outbound]:
        """Fetch ``message`` (or re-publish it for later); see the module docstring.

        Raises:
            TransientError: a retryable status or network error while
                ``delivery.delivered <= http_retries`` (``retry_after_s`` from a
                ``Retry-After`` header, RFC 9110 §10.2.3, capped); a body store failure.
        """
        url = message.url
        try:
            rules = await self._permit(url)
        except _Refused as refused:
            return [await self._page_out(message, url, error=str(refused))]
        delay = self.politeness.delay_for(message.host, rules.crawl_delay_s(self.settings.user_agent))
        waiting = time.perf_counter()
        later = await self._wait_or_defer(message, delay)
        if later is not None:
            metrics.POLITENESS_DEFERRED.inc()
            return [later]
        if self.before_fetch is not None:
            verdict = await self.before_fetch(message)
            if verdict == "drop":
                return []
            if verdict == "hold":
                return [self._reschedule(message, utc_now())]
        return [await self._fetch(message, delivery, delay, time.perf_counter() - waiting)]

    async def _permit(self, url: str) -> RobotsRules:
        """robots.txt rules of ``url`` if they allow it; raises :class:`_Refused` if not."""
        try:
            rules = await self.robots.rules_for(url)
        except EgressRefusedError as refused:
            raise _Refused(refused.describe(url)) from None
        if not rules.allows(url, self.settings.user_agent):
            metrics.ROBOTS_DECISIONS.labels("disallowed").inc()
            why = f" ({rules.note})" if rules.note else ""
            raise _Refused(f"{ROBOTS_DISALLOWS} {url}{why}")
        return rules

    async def _wait_or_defer(self, entry: FrontierEntry, delay_s: float) -> Outbound | None:
        """Sleep until ``entry`` is due if that is within the horizon (None), else return
        the entry re-published for its estimated due time.

        A fresh entry's due time is after its host's queue and after the entries already
        re-published for that host (it books its own slot). An entry re-published earlier
        keeps its ``not_before`` unless the queue is now longer; if it is still beyond the
        horizon it is held up to ``reschedule_hold_s`` before being re-published again, so
        a far-future entry does not circulate through the stream in a hot loop.
        """
        horizon = self.settings.queue_horizon_s
        held = False
        while True:
            now = utc_now()
            queue_s = self.politeness.queue_wait_s(entry.host, delay_s)
            scheduled_s = (entry.not_before - now).total_seconds() if entry.not_before else 0.0
            if scheduled_s > 0:  # re-published earlier: it already has its slot
                due_s = max(scheduled_s, queue_s)
            else:
                due_s = max(queue_s, self.politeness.booked_wait_s(entry.host))
            if due_s <= horizon:
                if scheduled_s > 0:
                    await asyncio.sleep(scheduled_s)
                return None
            if scheduled_s > 0 and not held and self.settings.reschedule_hold_s > 0:
                held = True  # came straight back: hold it a little rather than spin
                await asyncio.sleep(min(self.settings.reschedule_hold_s, due_s - horizon))
                continue
            if scheduled_s > 0 and scheduled_s >= queue_s:
                assert entry.not_before is not None
                return self._reschedule(entry, entry.not_before)
            if scheduled_s <= 0:
                self.politeness.book(entry.host, due_s, delay_s)
            return self._reschedule(entry, now + timedelta(seconds=due_s))

    def _reschedule(self, entry: FrontierEntry, not_before: datetime) -> Outbound:
        """``entry`` re-published to its frontier subject, due at ``not_before``, under a new
        generation (so the duplicate window does not drop it)."""
        generation = entry.generation + 1
        later = entry.model_copy(update={"generation": generation, "not_before": not_before})
        return Outbound(
            subjects.frontier(subjects.partition_of(entry.host), entry.tenant, entry.job_id),
            later,
            subjects.msg_id(FRONTIER_ID_STAGE, entry.tenant, entry.job_id, entry.fingerprint,
                            generation),
        )

    async def _fetch(self, entry: FrontierEntry, delivery: Delivery, delay_s: float,
                     waited_s: float = 0.0) -> Outbound:
        """Request ``entry`` and its redirect hops; the page to publish. ``waited_s``: how
        long the entry already waited for its slot, seconds."""
        url, host = entry.url, entry.host
        elapsed_s = 0.0
        for hop in range(self.settings.max_redirects + 1):
            if hop:
                try:
                    url = canonical_url(url)
                    rules = await self._permit(url)
                except UrlError as error:
                    return await self._page_out(entry, url, error=f"bad redirect: {error}")
                except _Refused as refused:
                    return await self._page_out(entry, url, error=str(refused))
                host = host_of(url)
                delay_s = self.politeness.delay_for(host, rules.crawl_delay_s(self.settings.user_agent))
            metrics.ROBOTS_DECISIONS.labels("allowed").inc()  # once per URL requested
            queued = time.perf_counter()
            try:
                async with self.politeness.turn(host, delay_s):
                    metrics.POLITENESS_WAIT.observe(waited_s + time.perf_counter() - queued)
                    waited_s, started = 0.0, time.perf_counter()
                    response = await self.downloader.get(
                        url, max_bytes=self.settings.max_body_bytes, wanted=self._wants_body,
                    )
            except EgressRefusedError as refused:
                return await self._page_out(entry, url, error=refused.describe(url))
            except FetchError as error:
                metrics.FETCH_DURATION.labels("error").observe(
                    elapsed_s + time.perf_counter() - started)
                if delivery.delivered <= self.http_retries:
                    raise TransientError(str(error)) from None
                return await self._page_out(entry, url, error=str(error), elapsed_s=elapsed_s)
            elapsed_s += response.elapsed_s
            location = response.headers.get("location")
            if response.status in REDIRECT_STATUSES and location:
                url = urljoin(url, location)
                continue
            _observe(response, elapsed_s)
            return await self._answer(entry, response, delivery, host, elapsed_s)
        _observe(response, elapsed_s)
        return await self._page_out(
            entry, url, error=f"more than {self.settings.max_redirects} redirects", elapsed_s=elapsed_s,
        )

    def _wants_body(self, status: int, media_type: str | None) -> bool:
        """Only successful HTML-ish answers are downloaded (no Content-Type counts as one)."""
        if not 200 <= status < 300:
            return False
        return media_type is None or media_type in self.settings.html_content_types

    async def _answer(self, entry: FrontierEntry, response: HttpResponse, delivery: Delivery,
                      host: str, elapsed_s: float) -> Outbound:
        """Retry a retryable status (while retries last), else report the response."""
        if response.status in self.settings.retry_http_codes:
            wait_s = retry_after_s(response.headers, cap_s=self.settings.retry_after_max_s)
            if wait_s:
                self.politeness.pause(host, wait_s)
            if delivery.delivered <= self.http_retries:
                raise TransientError(f"HTTP {response.status} from {response.url}",
                                     retry_after_s=wait_s)
        if response.truncated:
            return await self._page_out(
                entry, response.url, content_type=response.content_type, elapsed_s=elapsed_s,
                error=f"body exceeds {self.settings.max_body_bytes} bytes (decompressed)",
            )
        return await self._page_out(
            entry, response.url, status=response.status, content_type=response.content_type,
            body=response.body, elapsed_s=elapsed_s,
        )

    async def _page_out(self, entry: FrontierEntry, final_url: str, *, status: int = 0,
                        content_type: str | None = None, body: bytes = b"",
                        error: str | None = None, elapsed_s: float = 0.0) -> Outbound:
        """The :class:`FetchedPage` to publish (see :func:`pack_body`).

        Raises:
            TransientError: the body store failed.
        """
        packed = await pack_body(body, tenant=entry.tenant, job=entry.job_id,
                                 fingerprint=entry.fingerprint, store=self.bodies,
                                 inline_max_bytes=self.body_inline_max_bytes)
        page = FetchedPage(
            tenant=entry.tenant, job_id=entry.job_id, url=entry.url, final_url=final_url,
            fingerprint=entry.fingerprint, depth=entry.depth, status=status,
            content_type=content_type, elapsed_ms=elapsed_s * 1000, body_bytes=len(body),
            body_encoding=packed.encoding, body=packed.inline, body_ref=packed.ref, error=error,
        )
        return Outbound(
            subjects.fetched(entry.tenant, entry.job_id), page,
            subjects.msg_id(Stage.FETCHER, entry.tenant, entry.job_id, entry.fingerprint,
                            entry.generation),
        )


def _observe(response: HttpResponse, elapsed_s: float) -> None:
    """Record a fetch's final answer: duration over all hops (seconds) and body bytes."""
    status = status_class(response.status)
    metrics.FETCH_DURATION.labels(status).observe(elapsed_s)
    metrics.FETCH_RESPONSE_BYTES.labels(status).observe(len(response.body))
