"""The parser handler: a fetched page in; a parsed page and its outlinks out.

Every fetched page gives exactly two messages: a :class:`ParsedPage` for the sink and a
:class:`DiscoveredLinks` (origin ``outlinks``, possibly empty) for dedup, whose expansion
report the job's completion accounting waits for. Only a successful (2xx) HTML response
with a body is parsed; anything else passes its status, content type and error through.
A body that cannot be read, decompressed or parsed is a page error, never a dead letter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from services.parser.html import PageContent, PageLimits, is_html, read_page
from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.bus.outcomes import describe_error
from shared.codec import DecodeError, decompress
from shared.contracts import (
    BodyRef,
    DiscoveredLinks,
    ExtractionRule,
    FetchedPage,
    LinkOrigin,
    ParsedPage,
)
from shared.streams import bodies_bucket
from shared.subjects import Stage

log = logging.getLogger(__name__)


class BodyUnavailableError(Exception):
    """A stored body that is gone for good (expired, deleted, corrupt): a page error."""


class PageUnreadableError(Exception):
    """A page body that cannot be read, decompressed or parsed; the message says why."""


class BodyReader(Protocol):
    """Reads bodies kept in the Object Store (``FetchedPage.body_ref``)."""

    async def read(self, ref: BodyRef) -> bytes:
        """The stored (still compressed) bytes of ``ref``.

        Raises:
            BodyUnavailableError: the object is gone for good. Other errors are transient.
        """
        ...


class RulesSource(Protocol):
    """The extraction rules of a job (they are not carried on the pages)."""

    async def rules(self, tenant: str, job: str) -> tuple[ExtractionRule, ...]: ...


class ParserHandler:
    """Parses fetched HTML off the event loop (see module docstring)."""

    def __init__(self, bodies: BodyReader, rules: RulesSource, limits: PageLimits = PageLimits()) -> None:
        self.bodies = bodies
        self.rules = rules
        self.limits = limits

    async def handle(self, message: FetchedPage, delivery: Delivery) -> list[Outbound]:
        tenant, job, fp = message.tenant, message.job_id, message.fingerprint
        content, error = PageContent(), message.error
        if _parseable(message):
            try:
                content = await self._read(message)
            except PageUnreadableError as failure:
                error = str(failure)
        page = ParsedPage(
            tenant=tenant, job_id=job, url=message.url, final_url=message.final_url,
            fingerprint=fp, depth=message.depth, status=message.status,
            content_type=message.content_type, fetched_at=message.fetched_at,
            title=content.title, description=content.description,
            canonical_url=content.canonical_url, links_found=len(content.links),
            extracted=content.extracted, error=error,
        )
        links = DiscoveredLinks(
            tenant=tenant, job_id=job, origin=LinkOrigin.OUTLINKS, depth=message.depth + 1,
            source_url=message.url, source_fingerprint=fp, links=content.links,
        )
        return [
            Outbound(subjects.parsed(tenant, job), page,
                     subjects.msg_id(Stage.PARSER, tenant, job, fp)),
            Outbound(subjects.links(tenant, job), links,
                     subjects.msg_id(Stage.PARSER, tenant, job, f"links-{fp}")),
        ]

    async def _read(self, message: FetchedPage) -> PageContent:
        """Fetch the body and the job's rules, then decode and parse in a worker thread.

        Raises:
            PageUnreadableError: the body is gone, corrupt, too large or unparseable.
        """
        raw = message.body
        if message.body_ref is not None:
            ref = message.body_ref
            if ref.bucket != bodies_bucket(message.tenant):
                raise PageUnreadableError(f"body in bucket {ref.bucket!r}, not the tenant's")
            try:
                raw = await self.bodies.read(ref)
            except BodyUnavailableError as failure:
                raise PageUnreadableError(f"body unavailable: {failure}") from None
        rules = await self.rules.rules(message.tenant, message.job_id)
        return await asyncio.to_thread(_parse, raw, message, rules, self.limits)


def _parseable(message: FetchedPage) -> bool:
    has_body = message.body_bytes > 0 or message.body_ref is not None
    return (message.error is None and 200 <= message.status < 300
            and is_html(message.content_type) and has_body)


def _parse(
    raw: bytes, message: FetchedPage, rules: tuple[ExtractionRule, ...], limits: PageLimits
) -> PageContent:
    """Decompress and read one page (CPU-bound: runs in a worker thread)."""
    try:
        body = decompress(raw, message.body_encoding, limits.max_body_bytes)
    except DecodeError as failure:
        raise PageUnreadableError(f"undecodable body: {failure}") from None
    try:
        return read_page(body, message.content_type, message.final_url, rules, limits)
    except Exception as failure:  # lxml on hostile input: a page error, never a crash
        log.warning("cannot parse %s", message.final_url, exc_info=True)
        raise PageUnreadableError(f"unparseable HTML: {describe_error(failure)}") from None
