"""HTTP behaviour of the fetcher handler against real loopback sites: bodies, redirects,
size caps, retries, content types and the body store."""

from __future__ import annotations

import os
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler

import pytest

from services.fetcher.retry import retry_after_s
from shared import subjects
from shared.bus.outcomes import TransientError
from shared.codec import decode, decompress, encode
from shared.contracts import FetchedPage
from shared.streams import bodies_bucket
from tests.sites import Site
from tests.unit.fetcher.conftest import (
    JOB,
    TENANT,
    MakeHandler,
    MemoryBodies,
    delivery,
    entry,
    gzipped,
    respond,
)

HTML = b"<html><head><title>t</title></head><body>hello</body></html>"


async def fetch(handler, url: str, delivered: int = 1) -> FetchedPage:
    (out,) = await handler.handle(entry(url), delivery(delivered))
    page = decode(encode(out.message), FetchedPage)
    return page


async def test_html_page_travels_zlib_compressed(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/a": (200, "text/html; charset=utf-8", HTML)}
    (out,) = await make_handler().handle(entry(site.url("/a")), delivery())
    page = out.message
    assert isinstance(page, FetchedPage)
    assert out.subject == subjects.fetched(TENANT, JOB)
    assert out.msg_id == subjects.msg_id("fetcher", TENANT, JOB, page.fingerprint)
    assert (page.status, page.content_type, page.error) == (200, "text/html; charset=utf-8", None)
    assert page.body_encoding == "zlib" and page.body_bytes == len(HTML)
    assert decompress(page.body, "zlib") == HTML
    assert page.final_url == site.url("/a") and page.elapsed_ms > 0


async def test_gzip_body_is_decoded(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/z"] = lambda req: respond(req, 200, gzipped(HTML), Content_Encoding="gzip")
    page = await fetch(make_handler(), site.url("/z"))
    assert decompress(page.body, "zlib") == HTML


async def test_body_cap_applies_to_decompressed_bytes(site: Site, make_handler: MakeHandler) -> None:
    bomb = gzipped(b"\0" * (64 << 20))  # ~64 KiB on the wire, 64 MiB inflated
    site.routes["/bomb"] = lambda req: respond(req, 200, bomb, Content_Encoding="gzip")
    handler = make_handler(max_body_bytes=1 << 20)
    tracemalloc.start()
    try:
        page = await fetch(handler, site.url("/bomb"))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 8 << 20  # never inflated much beyond the cap
    assert page.status == 0
    assert page.error == f"body exceeds {1 << 20} bytes (decompressed)"
    assert page.body_bytes == 0


async def test_plain_body_cap(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/big": (200, "text/html", b"x" * 50_000)}
    page = await fetch(make_handler(max_body_bytes=10_000), site.url("/big"))
    assert page.error == "body exceeds 10000 bytes (decompressed)"


async def test_redirects_are_followed_by_hand(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/old"] = lambda req: respond(req, 301, Location="/mid")
    site.routes["/mid"] = lambda req: respond(req, 307, Location=site.url("/new"))
    site.pages = {"/new": (200, "text/html", HTML)}
    page = await fetch(make_handler(), site.url("/old"))
    assert (page.status, page.final_url, page.url) == (200, site.url("/new"), site.url("/old"))
    assert site.requests == ["/robots.txt", "/old", "/mid", "/new"]


async def test_redirect_chain_is_bounded(site: Site, make_handler: MakeHandler) -> None:
    for n in range(10):
        site.routes[f"/r{n}"] = lambda req, n=n: respond(req, 302, Location=f"/r{n + 1}")
    page = await fetch(make_handler(max_redirects=3), site.url("/r0"))
    assert page.status == 0 and page.error == "more than 3 redirects"
    assert site.requests == ["/robots.txt", "/r0", "/r1", "/r2", "/r3"]


async def test_redirect_hop_disallowed_by_robots_is_not_requested(
    site: Site, make_handler: MakeHandler
) -> None:
    site.routes["/go"] = lambda req: respond(req, 302, Location="/secret")
    site.pages = {"/robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /secret\n")}
    page = await fetch(make_handler(), site.url("/go"))
    assert page.error == f"robots.txt disallows {site.url('/secret')}"
    assert site.requests == ["/robots.txt", "/go"]


async def test_retryable_status_is_retried_then_reported(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/e": (500, "text/html", b"oops")}
    handler = make_handler(http_retries=2)
    for delivered in (1, 2):
        with pytest.raises(TransientError) as raised:
            await fetch(handler, site.url("/e"), delivered)
        assert raised.value.retry_after_s is None  # the consumer's backoff applies
    page = await fetch(handler, site.url("/e"), 3)
    assert (page.status, page.error, page.body) == (500, None, b"")
    assert site.requests.count("/e") == 3


async def test_non_retryable_status_is_reported_at_once(site: Site, make_handler: MakeHandler) -> None:
    page = await fetch(make_handler(), site.url("/missing"))  # Site answers 404
    assert (page.status, page.error, page.body_bytes) == (404, None, 0)


async def test_retry_after_becomes_retry_after_s_and_pauses_the_host(
    site: Site, make_handler: MakeHandler
) -> None:
    site.routes["/busy"] = lambda req: respond(req, 503, b"", Retry_After="7")
    site.routes["/flood"] = lambda req: respond(req, 429, b"", Retry_After="86400")
    handler = make_handler(retry_after_max_s=60)
    with pytest.raises(TransientError) as raised:
        await fetch(handler, site.url("/busy"))
    assert raised.value.retry_after_s == 7
    host = entry(site.url("/busy")).host
    assert 6 < handler.politeness.queue_wait_s(host, 0.0) <= 7
    with pytest.raises(TransientError) as capped:
        await make_handler(retry_after_max_s=60).handle(entry(site.url("/flood")), delivery())
    assert capped.value.retry_after_s == 60


def test_retry_after_http_date() -> None:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    later = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert retry_after_s({"retry-after": later}, cap_s=300, now=now) == 90
    assert retry_after_s({"retry-after": "Mon, 01 Jan 2001 00:00:00 GMT"}, cap_s=300, now=now) == 0
    assert retry_after_s({"retry-after": "soon"}, cap_s=300, now=now) is None
    assert retry_after_s({}, cap_s=300, now=now) is None


async def test_connection_failure_is_retried_then_reported(site: Site, make_handler: MakeHandler) -> None:
    def hang_up(req: BaseHTTPRequestHandler) -> None:
        req.close_connection = True  # no response at all

    site.routes["/drop"] = hang_up
    handler = make_handler(http_retries=1)
    with pytest.raises(TransientError):
        await fetch(handler, site.url("/drop"), 1)
    page = await fetch(handler, site.url("/drop"), 2)
    assert page.status == 0
    assert page.error is not None and "RemoteProtocolError" in page.error


async def test_total_timeout_bounds_a_trickling_response(site: Site, make_handler: MakeHandler) -> None:
    def trickle(req: BaseHTTPRequestHandler) -> None:
        req.send_response(200)
        req.send_header("Content-Type", "text/html")
        req.end_headers()
        try:
            for _ in range(40):
                req.wfile.write(b"x")
                req.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    site.routes["/slow"] = trickle
    handler = make_handler(read_timeout_s=0.5, total_timeout_s=0.4, http_retries=0)
    started = time.monotonic()
    page = await fetch(handler, site.url("/slow"))
    assert time.monotonic() - started < 1.5
    assert page.status == 0 and page.error is not None and "timed out after 0.4s" in page.error


async def test_non_html_is_reported_without_its_body(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/doc.pdf": (200, "application/pdf", os.urandom(200_000))}
    page = await fetch(make_handler(), site.url("/doc.pdf"))
    assert (page.status, page.content_type, page.error) == (200, "application/pdf", None)
    assert page.body_bytes == 0 and page.body == b"" and page.body_encoding == "identity"


async def test_content_types_are_configurable(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/feed": (200, "application/rss+xml", b"<rss/>")}
    page = await fetch(make_handler(html_content_types=["application/rss+xml"]), site.url("/feed"))
    assert decompress(page.body, "zlib") == b"<rss/>"


async def test_large_body_goes_to_the_body_store(
    site: Site, make_handler: MakeHandler, bodies: MemoryBodies
) -> None:
    body = b"<html>" + os.urandom(30_000).hex().encode() + b"</html>"
    site.pages = {"/big": (200, "text/html", body)}
    page = await fetch(make_handler(body_inline_max_bytes=4096), site.url("/big"))
    assert page.body == b"" and page.body_ref is not None and page.body_bytes == len(body)
    assert page.body_ref.bucket == bodies_bucket(TENANT)
    assert page.body_ref.name == f"{JOB}/{page.fingerprint}"
    stored = bodies.objects[(page.body_ref.bucket, page.body_ref.name)]
    assert page.body_ref.stored_bytes == len(stored)
    assert decompress(stored, "zlib") == body


async def test_small_body_stays_inline(site: Site, make_handler: MakeHandler, bodies: MemoryBodies) -> None:
    site.pages = {"/a": (200, "text/html", HTML)}
    page = await fetch(make_handler(body_inline_max_bytes=4096), site.url("/a"))
    assert page.body_ref is None and bodies.objects == {}


async def test_user_agent_comes_from_settings(site: Site, make_handler: MakeHandler) -> None:
    seen: list[str] = []

    def record(req: BaseHTTPRequestHandler) -> None:
        seen.append(req.headers.get("User-Agent", ""))
        respond(req, 200, HTML)

    site.routes["/ua"] = record
    await fetch(make_handler(user_agent="testbot/9"), site.url("/ua"))
    assert seen == ["testbot/9"]


@pytest.mark.parametrize("verdict", ["drop", "hold"])
async def test_before_fetch_is_asked_after_the_politeness_wait(
    site: Site, make_handler: MakeHandler, verdict: str,
) -> None:
    """A job cancelled (drop) or a tenant suspended (hold) while an entry waited for its
    host's turn: nothing is requested; a held entry comes back under the next generation."""
    site.pages = {"/a": (200, "text/html", HTML)}
    handler = make_handler()
    asked = []

    async def before_fetch(e):  # type: ignore[no-untyped-def]
        asked.append(e.url)
        return verdict

    handler.before_fetch = before_fetch
    out = await handler.handle(entry(site.url("/a")), delivery())
    assert asked == [site.url("/a")]
    assert not [path for path in site.requests if path == "/a"]
    if verdict == "drop":
        assert out == []
    else:
        (again,) = out
        assert again.subject.startswith("mesh.frontier.") and again.message.generation == 1
