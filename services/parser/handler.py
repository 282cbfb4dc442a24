"""The parser handler: a fetched page in; a parsed page and its outlinks out."""

from __future__ import annotations

from urllib.parse import urljoin

from parsel import Selector

from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.codec import decompress
from shared.contracts import DiscoveredLinks, FetchedPage, Link, LinkOrigin, ParsedPage
from shared.subjects import Stage


class ParserHandler:
    """Parses HTML with parsel; non-HTML and errors pass through as a parsed page."""

    async def handle(self, message: FetchedPage, delivery: Delivery) -> list[Outbound]:
        tenant, job, fp = message.tenant, message.job_id, message.fingerprint
        title = None
        links: list[Link] = []
        is_html = (message.content_type or "").startswith("text/html")
        if message.error is None and is_html and message.status == 200:
            html = decompress(message.body, message.body_encoding).decode("utf-8", "replace")
            selector = Selector(text=html, type="html")
            title = selector.css("title::text").get()
            seen: set[str] = set()
            for href in selector.css("a::attr(href)").getall():
                url = urljoin(message.final_url, href.strip())
                if url.startswith(("http://", "https://")) and url not in seen:
                    seen.add(url)
                    links.append(Link(url=url))
        page = ParsedPage(
            tenant=tenant, job_id=job, url=message.url, final_url=message.final_url,
            fingerprint=fp, depth=message.depth, status=message.status,
            content_type=message.content_type, fetched_at=message.fetched_at,
            title=title.strip() if title else None, links_found=len(links), error=message.error,
        )
        outputs = [Outbound(subjects.parsed(tenant, job), page,
                            subjects.msg_id(Stage.PARSER, tenant, job, fp))]
        outputs.append(Outbound(
            subjects.links(tenant, job),
            DiscoveredLinks(tenant=tenant, job_id=job, origin=LinkOrigin.OUTLINKS,
                            depth=message.depth + 1, source_url=message.url,
                            source_fingerprint=fp, links=tuple(links)),
            subjects.msg_id(Stage.PARSER, tenant, job, f"links-{fp}"),
        ))
        return outputs
