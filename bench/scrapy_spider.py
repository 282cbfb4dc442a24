"""The reference crawler: Scrapy's ``CrawlSpider`` over the corpus (issue 10).

One ``LinkExtractor`` rule following every link of the seeds' hosts (Scrapy's default
``deny_extensions`` skip non-HTML files), robots.txt off, 64 concurrent requests, the
title and the body text of each page extracted. The seeds are requested once (through the
duplicate filter, unlike ``start_urls``, which Scrapy requests with ``dont_filter=True`` so
that they come back a second time when linked), so every URL is fetched exactly once, as
crawlmesh does.

Runs in its own process and writes one JSON summary (wall and CPU seconds of the crawl,
responses by status, items, first-item latency, the URLs requested) to ``--summary``::

    python bench/scrapy_spider.py --summary /tmp/scrapy.json $(../shared/corpus/serve seeds)
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import scrapy
from scrapy import signals
from scrapy.crawler import CrawlerProcess
from scrapy.http import Response
from scrapy.linkextractors import LinkExtractor
from scrapy.spiders import CrawlSpider, Rule

DEFAULT_SEEDS = (
    "http://127.0.0.2:8080/index.html",
    "http://127.0.0.3:8080/index.html",
    "http://127.0.0.4:8080/index.html",
)
"""The corpus seeds (``../shared/corpus/serve seeds``)."""

SETTINGS: dict[str, Any] = {
    "ROBOTSTXT_OBEY": False,
    "CONCURRENT_REQUESTS": 64,
    "CONCURRENT_REQUESTS_PER_DOMAIN": 64,  # politeness lifted, as for crawlmesh's corpus hosts
    "DOWNLOAD_DELAY": 0,
    "LOG_LEVEL": "WARNING",
    "TELNETCONSOLE_ENABLED": False,
}
"""Scrapy settings of the reference crawl (everything else is Scrapy's default)."""


def cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def collapse(text: str | None) -> str:
    """``text`` with every run of whitespace made one space, stripped."""
    return " ".join((text or "").split())


class CorpusSpider(CrawlSpider):
    """Follows every same-host link from the seeds; one item (url, title, body text) per page."""

    name = "corpus"
    rules = (Rule(LinkExtractor(), callback="parse_page", follow=True),)

    def __init__(self, seeds: tuple[str, ...] = DEFAULT_SEEDS, **kwargs: Any) -> None:
        self.seeds = seeds
        self.allowed_domains = sorted({urlsplit(seed).hostname or "" for seed in seeds})
        super().__init__(**kwargs)

    async def start(self) -> AsyncIterator[scrapy.Request]:
        """The seeds, through the duplicate filter (see module docstring)."""
        for seed in self.seeds:
            yield scrapy.Request(seed)

    def parse_start_url(self, response: Response, **kwargs: Any) -> Iterator[dict[str, str]]:
        """The seed pages are pages too."""
        return self.parse_page(response)

    def parse_page(self, response: Response) -> Iterator[dict[str, str]]:
        """One item per HTML page: its URL, title and body text (whitespace collapsed)."""
        if not hasattr(response, "xpath"):  # not text (Scrapy's LinkExtractor lets few through)
            return
        yield {
            "url": response.url,
            "title": collapse(response.xpath("string((//title)[1])").get()),
            "body_text": collapse(response.xpath("string(//body)").get()),
        }


class Summary:
    """What the harness reads: timings, counts and the requested URLs (signal handlers)."""

    def __init__(self) -> None:
        self.opened_at = self.closed_at = self.first_item_at = 0.0
        self.cpu_at_open = self.cpu_at_close = 0.0
        self.statuses: Counter[int] = Counter()
        self.urls: list[str] = []
        self.items = 0

    def opened(self, spider: scrapy.Spider) -> None:
        self.opened_at, self.cpu_at_open = time.monotonic(), cpu_s()

    def closed(self, spider: scrapy.Spider, reason: str) -> None:
        self.closed_at, self.cpu_at_close = time.monotonic(), cpu_s()

    def response(self, response: Response, request: scrapy.Request, spider: scrapy.Spider) -> None:
        self.statuses[response.status] += 1
        self.urls.append(request.url)

    def item(self, item: dict[str, str], response: Response, spider: scrapy.Spider) -> None:
        self.items += 1
        if not self.first_item_at:
            self.first_item_at = time.monotonic()

    def as_json(self, stats: dict[str, Any]) -> dict[str, Any]:
        return {
            "crawler": "scrapy",
            "wall_s": self.closed_at - self.opened_at,
            "cpu_s": self.cpu_at_close - self.cpu_at_open,
            "first_result_s": self.first_item_at - self.opened_at if self.first_item_at else None,
            "pages": len(self.urls),
            "unique_urls": len(set(self.urls)),
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "items": self.items,
            "duplicates_filtered": stats.get("dupefilter/filtered", 0),
            "offsite_filtered": stats.get("offsite/filtered", 0),
            "urls": sorted(self.urls),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seeds", nargs="*", default=list(DEFAULT_SEEDS))
    parser.add_argument("--summary", type=Path, help="write the JSON summary here (else stdout)")
    parser.add_argument("--max-pages", type=int, default=0, help="stop after N responses (0: all)")
    args = parser.parse_args(argv)
    settings = dict(SETTINGS)
    if args.max_pages:
        settings["CLOSESPIDER_PAGECOUNT"] = args.max_pages
    process = CrawlerProcess(settings=settings)
    crawler = process.create_crawler(CorpusSpider)
    summary = Summary()
    crawler.signals.connect(summary.opened, signal=signals.spider_opened)
    crawler.signals.connect(summary.closed, signal=signals.spider_closed)
    crawler.signals.connect(summary.response, signal=signals.response_received)
    crawler.signals.connect(summary.item, signal=signals.item_scraped)
    process.crawl(crawler, seeds=tuple(args.seeds))
    process.start()
    assert crawler.stats is not None
    text = json.dumps(summary.as_json(crawler.stats.get_stats()))
    if args.summary:
        args.summary.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
