"""The CPU floor: one asyncio process doing crawlmesh's per-page work, nothing else.

httpx fetches (64 workers), parsel parses (title and body text, ``<a>``/``<area>`` links
resolved against ``<base href>``), each link is canonicalised and fingerprinted with
crawlmesh's own :func:`shared.urls.canonical_url` / :func:`shared.urls.fingerprint`, kept
to the seeds' hosts and de-duplicated in an in-memory set. No broker, no durability, no
politeness. Non-HTML responses are not downloaded (their status is a result, as in
crawlmesh).

Runs in its own process and writes one JSON summary like ``bench/scrapy_spider.py``::

    python bench/bare_loop.py --summary /tmp/bare.json $(../shared/corpus/serve seeds)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
from parsel import Selector

from shared.urls import UrlError, canonical_url, fingerprint

DEFAULT_SEEDS = (
    "http://127.0.0.2:8080/index.html",
    "http://127.0.0.3:8080/index.html",
    "http://127.0.0.4:8080/index.html",
)
CONCURRENCY = 64
"""Requests in flight (as the Scrapy reference)."""


def cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def collapse(text: str | None) -> str:
    """``text`` with every run of whitespace made one space, stripped."""
    return " ".join((text or "").split())


def parse_page(body: bytes, encoding: str | None, url: str) -> tuple[dict[str, str], list[str]]:
    """The page's record (url, title, body text) and its absolute outlinks (fragment kept;
    canonicalisation drops it)."""
    selector = Selector(text=body.decode(encoding or "utf-8", "replace"), type="html",
                        base_url=url)
    base = url
    for element in selector.root.iter("base"):
        href = element.get("href")
        if href is not None:
            base = urljoin(url, href.strip())
            break
    links = [urljoin(base, href.strip()) for element in selector.root.iter("a", "area")
             if (href := element.get("href")) is not None]
    record = {"url": url, "title": collapse(selector.xpath("string((//title)[1])").get()),
              "body_text": collapse(selector.xpath("string(//body)").get())}
    return record, links


class BareCrawler:
    """A frontier queue, a seen set of fingerprints, and ``CONCURRENCY`` workers."""

    def __init__(self, seeds: tuple[str, ...], max_pages: int = 0) -> None:
        self.hosts = {urlsplit(seed).netloc for seed in seeds}
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.seen: set[str] = set()
        self.max_pages = max_pages
        self.statuses: Counter[int] = Counter()
        self.urls: list[str] = []
        self.duplicates = 0
        self.first_result_at = 0.0
        for seed in seeds:
            self.admit(seed)

    def admit(self, url: str) -> None:
        """Canonicalise, scope to the seeds' hosts, de-duplicate, enqueue."""
        try:
            canonical = canonical_url(url)
        except UrlError:
            return
        if urlsplit(canonical).netloc not in self.hosts:
            return
        key = fingerprint(canonical)
        if key in self.seen:
            self.duplicates += 1
            return
        if self.max_pages and len(self.seen) >= self.max_pages:
            return
        self.seen.add(key)
        self.queue.put_nowait(canonical)

    async def worker(self, client: httpx.AsyncClient) -> None:
        while True:
            url = await self.queue.get()
            try:
                await self.fetch(client, url)
            except httpx.HTTPError:
                self.statuses[0] += 1
            finally:
                self.queue.task_done()

    async def fetch(self, client: httpx.AsyncClient, url: str) -> None:
        async with client.stream("GET", url) as response:
            self.urls.append(url)
            self.statuses[response.status_code] += 1
            content_type = response.headers.get("content-type", "")
            if response.status_code != 200 or "html" not in content_type:
                self.result()
                return
            body = await response.aread()
        _record, links = parse_page(body, response.charset_encoding, str(response.url))
        self.result()
        for link in links:
            self.admit(link)

    def result(self) -> None:
        if not self.first_result_at:
            self.first_result_at = time.monotonic()

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
            workers = [asyncio.create_task(self.worker(client)) for _ in range(CONCURRENCY)]
            await self.queue.join()
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seeds", nargs="*", default=list(DEFAULT_SEEDS))
    parser.add_argument("--summary", type=Path, help="write the JSON summary here (else stdout)")
    parser.add_argument("--max-pages", type=int, default=0, help="admit at most N URLs (0: all)")
    args = parser.parse_args(argv)
    crawler = BareCrawler(tuple(args.seeds), args.max_pages)
    started, cpu_started = time.monotonic(), cpu_s()
    asyncio.run(crawler.run())
    summary: dict[str, Any] = {
        "crawler": "bare",
        "wall_s": time.monotonic() - started,
        "cpu_s": cpu_s() - cpu_started,
        "first_result_s": crawler.first_result_at - started if crawler.first_result_at else None,
        "pages": len(crawler.urls),
        "unique_urls": len(set(crawler.urls)),
        "statuses": {str(k): v for k, v in sorted(crawler.statuses.items())},
        "duplicates_filtered": crawler.duplicates,
        "urls": sorted(crawler.urls),
    }
    text = json.dumps(summary)
    if args.summary:
        args.summary.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
