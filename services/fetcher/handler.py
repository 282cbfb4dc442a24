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
from urllib.parse import urlsplit

import httpcore
from w3lib.html import get_meta_refresh

from services.fetcher.bodies import BodyStore, pack_body
from services.fetcher.downloader import (
    REDIRECT_STATUSES,
    Downloader,
    FetchError,
    HttpResponse,
    build_client,
    location_of,
    resolve_location,
)
from services.fetcher.egress import EgressPolicy, EgressRefusedError
from services.fetcher.hoststate import HostStore
from services.fetcher.politeness import CHECK_S, HostPoliteness, LeaseLost
from services.fetcher.retry import RetryPolicy, retry_after_s
from services.fetcher.robots import RobotsCache, RobotsRules, RobotsStore
from services.fetcher.settings import FetcherSettings
from services.parser.html import decode_html
from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.bus.outcomes import TransientError
from shared.contracts import (
    DiscoveredLinks,
    FetchedPage,
    FrontierEntry,
    Link,
    LinkOrigin,
    ParsedPage,
    utc_now,
)
from shared.subjects import Stage
from shared.telemetry import metrics
from shared.telemetry.metrics import status_class
from shared.urls import UrlError, canonical_url, host_of

ROBOTS_DISALLOWS = "robots.txt disallows"
"""Prefix of the error of a URL robots.txt disallows (the sink's ``robots_disallowed``)."""

EGRESS_REFUSES = "egress policy refuses"
"""Prefix of the error of a URL whose address the egress policy refuses."""

META_REFRESH_MAX_DELAY_S = 100.0
"""A ``<meta http-equiv=refresh>`` with a longer delay is not followed (Scrapy's
``METAREFRESH_MAXDELAY``): the page is the content."""

META_REFRESH_SCAN_BYTES = 64 * 1024
"""Bytes at the start of an HTML body searched for a meta refresh (it belongs in <head>)."""

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
        self.egress = EgressPolicy(settings.egress_allow)
        self.retry = RetryPolicy(frozenset(settings.retry_http_codes), retries=http_retries)
        """Which outcomes are retried (:mod:`~services.fetcher.retry`)."""
        self.before_fetch: Callable[[FrontierEntry], Awaitable[BeforeFetch]] | None = None
        """Asked once an entry's turn has come, just before its request: an entry may wait
        for its host's turn for up to ``queue_horizon_s`` seconds, and its job may be
        cancelled or its tenant suspended meanwhile (``"drop"``: nothing is fetched;
        ``"hold"``: re-published under the next generation; None: fetch)."""
        self.lease_check: Callable[[str], bool] | None = None
        """True while this fetcher owns the frontier partition of a host (set by the service:
        :mod:`services.fetcher.leases`); checked before robots.txt, while waiting and right
        before each request. An entry whose partition was lost is re-published, not fetched."""

    @classmethod
    def build(cls, settings: FetcherSettings, *, robots_store: RobotsStore, bodies: BodyStore,
              body_inline_max_bytes: int, http_retries: int | None = None,
              network_backend: httpcore.AsyncNetworkBackend | None = None,
              host_store: HostStore | None = None) -> FetcherHandler:
        """Assemble a handler and its HTTP client from settings (``network_backend``: see
        :func:`~services.fetcher.downloader.build_client`)."""
        client = build_client(settings, EgressPolicy(settings.egress_allow), network_backend)
        downloader = Downloader(client, settings.total_timeout_s)
        return cls(
            settings, downloader=downloader,
            robots=RobotsCache(downloader, robots_store, settings),
            politeness=HostPoliteness.from_settings(settings, host_store),
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
        guard = self._guard(message)
        try:
            guard()  # not our partition (any more): not even its robots.txt
            try:
                rules = await self._permit(url)
            except _Refused as refused:
                return [await self._page_out(message, url, error=str(refused))]
            rule = self.politeness.rule_for(message.host,
                                            rules.crawl_delay_s(self.settings.user_agent))
            waiting = time.perf_counter()
            later = await self._wait_or_defer(message, rule.delay_s, guard,
                                              horizon=0.0 if rule.defer else None)
            if later is not None:
                metrics.POLITENESS_DEFERRED.inc()
                return [later]
            if self.before_fetch is not None:
                verdict = await self.before_fetch(message)
                if verdict == "drop":
                    return []
                if verdict == "hold":
                    return [self._reschedule(message, utc_now())]
            return await self._fetch(message, delivery, rule.delay_s,
                                     time.perf_counter() - waiting)
        except LeaseLost:  # re-published for the partition's new owner (never nak'd)
            return [self._reschedule(message, message.not_before or utc_now())]

    def _guard(self, entry: FrontierEntry) -> Callable[[], None]:
        """Raises :class:`LeaseLost` once this fetcher no longer owns ``entry``'s host."""
        check = self.lease_check

        def guard() -> None:
            if check is not None and not check(entry.host):
                raise LeaseLost(entry.host)

        return guard

    @staticmethod
    async def _sleep(seconds: float, guard: Callable[[], None]) -> None:
        """Sleep ``seconds``, checking ``guard`` every :data:`CHECK_S`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            guard()
            await asyncio.sleep(min(left, CHECK_S))
        guard()

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

    async def _wait_or_defer(self, entry: FrontierEntry, delay_s: float,
                             guard: Callable[[], None] = lambda: None,
                             horizon: float | None = None) -> Outbound | None:
        """Sleep until ``entry`` is due if that is within the horizon (None), else return
        the entry re-published for its estimated due time.

        A fresh entry's due time is after its host's queue and after the entries already
        re-published for that host (it books its own slot). An entry re-published earlier
        keeps its ``not_before`` unless the queue is now longer; if it is still beyond the
        horizon it is held up to ``reschedule_hold_s`` before being re-published again, so
        a far-future entry does not circulate through the stream in a hot loop.
        """
        horizon = self.settings.queue_horizon_s if horizon is None else horizon
        held = False
        while True:
            now = utc_now()
            queue_s = self.politeness.queue_wait_s(entry.host, delay_s, entry.tenant)
            scheduled_s = (entry.not_before - now).total_seconds() if entry.not_before else 0.0
            if scheduled_s > 0:  # re-published earlier: it already has its slot
                due_s = max(scheduled_s, queue_s)
            else:
                due_s = max(queue_s, self.politeness.booked_wait_s(entry.host, entry.tenant))
            if due_s <= horizon:
                if scheduled_s > 0:
                    await self._sleep(scheduled_s, guard)
                return None
            if scheduled_s > 0 and not held and self.settings.reschedule_hold_s > 0:
                held = True  # came straight back: hold it a little rather than spin
                await self._sleep(min(self.settings.reschedule_hold_s, due_s - horizon), guard)
                continue
            if scheduled_s > 0 and scheduled_s >= queue_s:
                assert entry.not_before is not None
                return self._reschedule(entry, entry.not_before)
            if scheduled_s <= 0:
                self.politeness.book(entry.host, due_s, delay_s, entry.tenant)
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
                     waited_s: float = 0.0) -> list[Outbound]:
        """Request ``entry`` and its same-host redirect hops; what to publish. ``waited_s``:
        how long the entry already waited for its slot, seconds.

        A redirect (3xx with a ``Location``) or an HTML page's ``<meta http-equiv=refresh>``
        (delay up to :data:`META_REFRESH_MAX_DELAY_S`) is resolved as a browser would
        (:func:`~services.fetcher.downloader.resolve_location`). To the same host it is the
        next hop, requested here after robots.txt, politeness and (at connect time) the
        egress policy; at most ``max_redirects`` hops, and a URL seen before in the chain
        is a loop (an error result). A target whose host is an IP literal the egress policy
        refuses is refused at once. To another host it is not requested: see
        :meth:`_redirected` (a host name is checked by the egress policy at connect time
        when its own entry is fetched).
        """
        url, host = entry.url, entry.host
        seen = {url}
        elapsed_s = 0.0
        # Hops already followed on other hosts count too (entry.redirects; see _redirected).
        for hop in range(max(self.settings.max_redirects - entry.redirects, 0) + 1):
            if hop:
                try:
                    rules = await self._permit(url)
                except _Refused as refused:
                    return [await self._page_out(entry, url, error=str(refused))]
                delay_s = self.politeness.delay_for(host, rules.crawl_delay_s(self.settings.user_agent))
            metrics.ROBOTS_DECISIONS.labels("allowed").inc()  # once per URL requested
            queued = time.perf_counter()
            try:
                async with self.politeness.turn(host, delay_s, self._guard(entry),
                                                tenant=entry.tenant) as turn:
                    metrics.POLITENESS_WAIT.observe(waited_s + time.perf_counter() - queued)
                    waited_s, started = 0.0, time.perf_counter()
                    response = await self.downloader.get(
                        url, max_bytes=self.settings.max_body_bytes, wanted=self._wants_body,
                        on_sent=turn.sent,
                    )
            except EgressRefusedError as refused:
                return [await self._page_out(entry, url, error=refused.describe(url))]
            except FetchError as error:
                metrics.FETCH_DURATION.labels("error").observe(
                    elapsed_s + time.perf_counter() - started)
                if self.retry.failure_is_transient(error.kind) and self.retry.may_retry(delivery.delivered):
                    raise TransientError(str(error)) from None
                return [await self._page_out(entry, url, error=str(error), elapsed_s=elapsed_s)]
            elapsed_s += response.elapsed_s
            try:
                target = _next_hop(response)
                if target is not None:
                    target = canonical_url(target)
            except UrlError as error:
                _observe(response, elapsed_s)
                return [await self._page_out(entry, url, error=f"bad redirect: {error}",
                                             elapsed_s=elapsed_s)]
            if target is None:
                _observe(response, elapsed_s)
                return [await self._answer(entry, response, delivery, host, elapsed_s)]
            if target in seen:
                _observe(response, elapsed_s)
                return [await self._page_out(entry, url, error=f"redirect loop: {url} -> {target}",
                                             elapsed_s=elapsed_s)]
            if (refused_ip := self.egress.refused_literal(urlsplit(target).hostname)) is not None:
                _observe(response, elapsed_s)  # an SSRF attempt: not even handed to dedup
                return [await self._page_out(entry, target, elapsed_s=elapsed_s,
                                             error=f"{EGRESS_REFUSES} {refused_ip} for {target}")]
            if host_of(target) != host:
                _observe(response, elapsed_s)
                if entry.redirects + hop + 1 > self.settings.max_redirects:
                    break  # an endless chain across hosts ends here, as on one host
                return self._redirected(entry, response, target, elapsed_s, hop + 1)
            seen.add(target)
            url = target
        else:
            _observe(response, elapsed_s)
        return [await self._page_out(
            entry, url, error=f"more than {self.settings.max_redirects} redirects", elapsed_s=elapsed_s,
        )]

    def _redirected(self, entry: FrontierEntry, response: HttpResponse, target: str,
                    elapsed_s: float, hops: int) -> list[Outbound]:
        """A redirect or meta refresh to another host goes back through dedup, so the target
        host's robots.txt, politeness budget, the job's scope and page budget all apply.

        Two messages, in place of what the parser would publish for this page (so the
        page still gets exactly one result and one expansion report): a
        :class:`DiscoveredLinks` of origin ``redirect`` holding the target (at the page's
        own depth: it is the same document; ``redirects`` = the entry's + ``hops`` followed
        here, so a chain across hosts stops after ``max_redirects`` hops in all, where
        depth alone would let it run until the job's page budget is spent), and the page's
        result, a :class:`ParsedPage`
        with the answer's status (3xx, or the refreshing page's), ``final_url`` the target
        (not requested) and no error.
        """
        tenant, job, fp = entry.tenant, entry.job_id, entry.fingerprint
        links = DiscoveredLinks(
            tenant=tenant, job_id=job, origin=LinkOrigin.REDIRECT, depth=entry.depth,
            source_url=entry.url, source_fingerprint=fp, links=(Link(url=target),),
            redirects=entry.redirects + hops,
        )
        page = ParsedPage(
            tenant=tenant, job_id=job, url=entry.url, final_url=target, fingerprint=fp,
            depth=entry.depth, status=response.status, content_type=response.content_type,
            fetched_at=utc_now(), links_found=1,
        )
        return [
            Outbound(subjects.links(tenant, job), links,
                     subjects.msg_id(Stage.FETCHER, tenant, job, f"redirect-{fp}", entry.generation)),
            Outbound(subjects.parsed(tenant, job), page,
                     subjects.msg_id(Stage.FETCHER, tenant, job, f"parsed-{fp}", entry.generation)),
        ]

    def _wants_body(self, status: int, media_type: str | None) -> bool:
        """The content-type policy: only successful answers of a media type in
        ``html_content_types`` (or without a ``Content-Type``) are downloaded, to be parsed;
        any other answer is recorded (status, content type) without its body."""
        if not 200 <= status < 300:
            return False
        return media_type is None or media_type in self.settings.html_content_types

    async def _answer(self, entry: FrontierEntry, response: HttpResponse, delivery: Delivery,
                      host: str, elapsed_s: float) -> Outbound:
        """Retry a retryable status (while retries last), else report the response."""
        if self.retry.status_is_transient(response.status):
            wait_s = retry_after_s(response.headers, cap_s=self.settings.retry_after_max_s)
            if wait_s:
                self.politeness.pause(host, wait_s)
            self.politeness.penalise(host)
            if self.retry.may_retry(delivery.delivered):
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


def _next_hop(response: HttpResponse) -> str | None:
    """Where ``response`` sends the client, absolute (not yet canonical), or None: the
    ``Location`` of a redirect status, else the URL of a ``<meta http-equiv=refresh>``
    of a whole 2xx HTML body with a delay up to :data:`META_REFRESH_MAX_DELAY_S`."""
    if response.status in REDIRECT_STATUSES:
        location = location_of(response.headers)
        return resolve_location(response.url, location) if location is not None else None
    if not (200 <= response.status < 300 and response.body) or response.truncated:
        return None
    text = decode_html(response.body[:META_REFRESH_SCAN_BYTES], response.content_type)
    delay_s, refresh = get_meta_refresh(text, response.url)
    if refresh is None or delay_s is None or delay_s > META_REFRESH_MAX_DELAY_S:
        return None
    return resolve_location(response.url, refresh)
