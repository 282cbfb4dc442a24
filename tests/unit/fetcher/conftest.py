"""Fixtures of the fetcher unit tests: real loopback sites, in-memory fakes of our stores.

HTTP is never mocked: every request goes to a :class:`tests.sites.Site` on 127.0.0.1.
The fakes are of the fetcher's own protocols (:class:`RobotsStore`, :class:`BodyStore`);
no NATS is involved.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from services.fetcher.handler import FetcherHandler
from services.fetcher.settings import FetcherSettings
from shared.bus.loop import Delivery
from shared.contracts import FrontierEntry
from shared.urls import canonical_url, fingerprint, host_of
from tests.sites import Site

TENANT = "ATESTTENANT"
JOB = "job1"


class MemoryRobotsStore:
    """The robots store protocol over a dict (counts reads and writes)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.puts = 0

    async def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    async def put(self, key: str, value: bytes) -> None:
        self.puts += 1
        self.data[key] = value


class MemoryBodies:
    """The body store protocol over a dict keyed by (bucket, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}

    async def put(self, bucket: str, name: str, data: bytes) -> None:
        self.objects[(bucket, name)] = data


def respond(req: BaseHTTPRequestHandler, status: int, body: bytes = b"",
            content_type: str = "text/html", **headers: str) -> None:
    """Write a whole response from a :class:`Site` route."""
    req.send_response(status)
    req.send_header("Content-Type", content_type)
    req.send_header("Content-Length", str(len(body)))
    for name, value in headers.items():
        req.send_header(name.replace("_", "-"), value)
    req.end_headers()
    req.wfile.write(body)


def gzipped(body: bytes) -> bytes:
    return gzip.compress(body, 9)


class Stamps:
    """A route that records the monotonic time of each request and serves a small page."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, req: BaseHTTPRequestHandler) -> None:
        self.times.append(time.monotonic())
        respond(req, 200, b"<html><body>ok</body></html>")

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def entry(url: str, *, generation: int = 0, not_before: datetime | None = None) -> FrontierEntry:
    """A frontier entry for ``url`` as dedup would admit it."""
    canonical = canonical_url(url)
    return FrontierEntry(
        tenant=TENANT, job_id=JOB, url=canonical, fingerprint=fingerprint(canonical),
        host=host_of(canonical), depth=1, generation=generation, not_before=not_before,
    )


def delivery(delivered: int = 1) -> Delivery:
    return Delivery(subject=f"mesh.frontier.0.{TENANT}.{JOB}", headers={}, delivered=delivered,
                    stream_seq=1, tenant=TENANT, job=JOB)


@pytest.fixture(scope="session")
def _shared_site() -> Iterator[Site]:
    site = Site().start()
    yield site
    site.stop()  # takes up to 0.5 s (the server's poll interval): once per session


@pytest.fixture
def site(_shared_site: Site) -> Site:
    """A loopback site with no pages, routes or logged requests (reset for each test)."""
    for table in (_shared_site.pages, _shared_site.routes, _shared_site.requests):
        table.clear()
    return _shared_site


@pytest.fixture(scope="session")
def _other_site() -> Iterator[Site]:
    site = Site().start()
    yield site
    site.stop()


@pytest.fixture
def other_site(_other_site: Site) -> Site:
    """A second loopback site (another origin), reset for each test."""
    for table in (_other_site.pages, _other_site.routes, _other_site.requests):
        table.clear()
    return _other_site


@pytest.fixture
def robots_store() -> MemoryRobotsStore:
    return MemoryRobotsStore()


@pytest.fixture
def bodies() -> MemoryBodies:
    return MemoryBodies()


MakeHandler = Callable[..., FetcherHandler]


@pytest.fixture
async def make_handler(
    robots_store: MemoryRobotsStore, bodies: MemoryBodies,
) -> AsyncIterator[MakeHandler]:
    """Builds handlers with fast test settings (loopback allowed, no delay) plus overrides.

    Keyword arguments are :class:`FetcherSettings` fields, or ``body_inline_max_bytes``,
    ``http_retries``, ``network_backend``, ``robots_store``.
    """
    made: list[FetcherHandler] = []

    def make(**overrides: Any) -> FetcherHandler:
        build = {k: overrides.pop(k) for k in
                 ("body_inline_max_bytes", "http_retries", "network_backend", "robots_store")
                 if k in overrides}
        fields: dict[str, Any] = {
            "egress_allow": ["127.0.0.0/8"], "default_delay_s": 0.0,
            "connect_timeout_s": 2.0, "read_timeout_s": 2.0, "total_timeout_s": 5.0,
        }
        fields.update(overrides)
        handler = FetcherHandler.build(
            FetcherSettings(**fields), robots_store=build.get("robots_store", robots_store),
            bodies=bodies, body_inline_max_bytes=build.get("body_inline_max_bytes", 512 * 1024),
            http_retries=build.get("http_retries"), network_backend=build.get("network_backend"),
        )
        made.append(handler)
        return handler

    yield make
    for handler in made:
        await handler.aclose()
