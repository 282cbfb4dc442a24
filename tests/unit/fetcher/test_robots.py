"""robots.txt (RFC 9309) against real loopback sites: obeyed, fetched once, cached, shared."""

from __future__ import annotations

import asyncio
import time
from http.server import BaseHTTPRequestHandler

import pytest

from services.fetcher.handler import ROBOTS_DISALLOWS
from services.fetcher.robots import RobotsRules, RobotsVerdict, origin_of, store_key
from services.fetcher.settings import FetcherSettings
from shared.codec import decode, encode
from shared.contracts import FetchedPage
from tests.sites import Site
from tests.unit.fetcher.conftest import (
    MakeHandler,
    MemoryRobotsStore,
    Stamps,
    delivery,
    entry,
    respond,
)

PAGE = (200, "text/html", b"<html><body>page</body></html>")


def page_of(outputs: list) -> FetchedPage:
    assert len(outputs) == 1
    page = outputs[0].message
    assert isinstance(page, FetchedPage)
    return decode(encode(page), FetchedPage)  # it survives the wire


async def test_disallowed_url_is_reported_and_never_requested(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {
        "/robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /private\n"),
        "/open": PAGE, "/private/x": PAGE,
    }
    handler = make_handler()
    blocked = page_of(await handler.handle(entry(site.url("/private/x")), delivery()))
    assert blocked.status == 0
    assert blocked.error == f"{ROBOTS_DISALLOWS} {site.url('/private/x')}"
    allowed = page_of(await handler.handle(entry(site.url("/open")), delivery()))
    assert allowed.status == 200 and allowed.error is None
    assert site.requests == ["/robots.txt", "/open"]


async def test_group_for_our_user_agent_wins(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {
        "/robots.txt": (200, "text/plain",
                        b"User-agent: *\nDisallow: /\n\nUser-agent: crawlmesh\nAllow: /\n"),
        "/a": PAGE,
    }
    page = page_of(await make_handler().handle(entry(site.url("/a")), delivery()))
    assert page.status == 200


async def test_robots_fetched_once_per_origin_even_concurrently(
    site: Site, make_handler: MakeHandler
) -> None:
    site.pages = {"/robots.txt": (200, "text/plain", b"User-agent: *\nAllow: /\n"),
                  "/a": PAGE, "/b": PAGE, "/c": PAGE}
    handler = make_handler()
    await asyncio.gather(*(handler.handle(entry(site.url(p)), delivery()) for p in ("/a", "/b", "/c")))
    assert site.requests.count("/robots.txt") == 1
    assert sorted(site.requests) == ["/a", "/b", "/c", "/robots.txt"]


async def test_robots_404_allows_everything(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/a": PAGE}  # /robots.txt answers 404
    page = page_of(await make_handler().handle(entry(site.url("/a")), delivery()))
    assert page.status == 200
    assert site.requests == ["/robots.txt", "/a"]


async def test_robots_500_disallows_everything_briefly(
    site: Site, make_handler: MakeHandler, robots_store: MemoryRobotsStore
) -> None:
    site.pages = {"/robots.txt": (500, "text/plain", b"oops"), "/a": PAGE}
    page = page_of(await make_handler(robots_error_ttl_s=60).handle(entry(site.url("/a")), delivery()))
    assert page.status == 0
    assert page.error is not None and page.error.startswith(f"{ROBOTS_DISALLOWS} {site.url('/a')}")
    assert "HTTP 500" in page.error
    assert site.requests == ["/robots.txt"]
    (stored,) = robots_store.data.values()
    rules = RobotsRules.from_bytes(stored)
    assert rules.verdict is RobotsVerdict.DISALLOW_ALL
    assert rules.expires_at - time.time() < 61


async def test_unreachable_robots_disallows(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/robots.txt"] = lambda req: setattr(req, "close_connection", True)  # no answer
    site.pages = {"/a": PAGE}
    page = page_of(await make_handler().handle(entry(site.url("/a")), delivery()))
    assert page.error is not None and page.error.startswith(ROBOTS_DISALLOWS)
    assert "unreachable" in page.error
    assert "/a" not in site.requests


async def test_shared_store_spares_other_fetchers_the_fetch(
    site: Site, make_handler: MakeHandler, robots_store: MemoryRobotsStore
) -> None:
    site.pages = {"/robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /x\n"), "/a": PAGE}
    await make_handler().handle(entry(site.url("/a")), delivery())
    other = make_handler()  # another process: empty in-process cache, same store
    page = page_of(await other.handle(entry(site.url("/x")), delivery()))
    assert page.error == f"{ROBOTS_DISALLOWS} {site.url('/x')}"
    assert site.requests.count("/robots.txt") == 1
    assert list(robots_store.data) == [store_key(origin_of(site.base))]


async def test_expired_record_is_refetched(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/robots.txt": (200, "text/plain", b"User-agent: *\nAllow: /\n"), "/a": PAGE}
    handler = make_handler(robots_ttl_s=0.05)
    await handler.handle(entry(site.url("/a")), delivery())
    await asyncio.sleep(0.1)
    await handler.handle(entry(site.url("/a")), delivery())
    assert site.requests.count("/robots.txt") == 2


async def test_robots_redirects_followed_up_to_five(site: Site, make_handler: MakeHandler) -> None:
    def hop(n: int, last: str):
        return lambda req: respond(req, 301, Location=f"/r{n + 1}" if n < 4 else last)

    site.routes["/robots.txt"] = lambda req: respond(req, 301, Location="/r1")
    for n in range(1, 5):
        site.routes[f"/r{n}"] = hop(n, "/real-robots.txt")
    site.pages = {"/real-robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /x\n"),
                  "/x": PAGE}
    page = page_of(await make_handler().handle(entry(site.url("/x")), delivery()))
    assert page.error == f"{ROBOTS_DISALLOWS} {site.url('/x')}"  # 5 hops: rules found


async def test_robots_redirecting_too_often_counts_as_unavailable(
    site: Site, make_handler: MakeHandler
) -> None:
    site.routes["/robots.txt"] = lambda req: respond(req, 302, Location="/robots.txt")
    site.pages = {"/x": PAGE}
    page = page_of(await make_handler().handle(entry(site.url("/x")), delivery()))
    assert page.status == 200  # RFC 9309 §2.3.1.2: MAY assume unavailable -> allow
    assert site.requests.count("/robots.txt") == 6


async def test_robots_parse_cap(site: Site, make_handler: MakeHandler) -> None:
    padding = b"# " + b"x" * 2000 + b"\n"
    text = b"User-agent: *\nDisallow: /early\n" + padding * 10 + b"Disallow: /late\n"
    site.pages = {"/robots.txt": (200, "text/plain", text), "/early": PAGE, "/late": PAGE}
    handler = make_handler(robots_max_bytes=10_000)
    assert page_of(await handler.handle(entry(site.url("/early")), delivery())).status == 0
    assert page_of(await handler.handle(entry(site.url("/late")), delivery())).status == 200


async def test_crawl_delay_spaces_requests_up_to_the_ceiling(
    site: Site, make_handler: MakeHandler
) -> None:
    stamps = Stamps()
    site.routes.update({"/a": stamps, "/b": stamps, "/c": stamps})
    site.pages = {"/robots.txt": (200, "text/plain", b"User-agent: *\nCrawl-delay: 0.4\n")}
    handler = make_handler(host_delays={"127.0.0.*": 0})
    await asyncio.gather(*(handler.handle(entry(site.url(p)), delivery()) for p in ("/a", "/b")))
    assert min(stamps.gaps()) >= 0.38

    site.pages["/robots.txt"] = (200, "text/plain", b"User-agent: *\nCrawl-delay: 60\n")
    stamps.times.clear()
    capped = make_handler(crawl_delay_max_s=0.2, robots_store=MemoryRobotsStore())
    await asyncio.gather(*(capped.handle(entry(site.url(p)), delivery()) for p in ("/a", "/b", "/c")))
    assert all(0.18 <= gap < 1.0 for gap in stamps.gaps())


def test_origin_and_store_key() -> None:
    assert origin_of("http://Example.com/a?b") == "http://example.com:80"
    assert origin_of("https://example.com:8443/") == "https://example.com:8443"
    assert origin_of("http://[::1]:8080/") == "http://[::1]:8080"
    assert store_key("http://example.com:80") == "http.80.example.com"
    assert store_key("http://[::1]:8080") == "http.8080.__1"


# --- RFC 9309, one test per rule -------------------------------------------------------

UA = "crawlmesh/0.1 (+https://github.com/crawlmesh/crawlmesh)"


def rules(text: str) -> RobotsRules:
    return RobotsRules(RobotsVerdict.RULES, time.time() + 60, 200, text)


def allowed(text: str, path: str, user_agent: str = UA) -> bool:
    return rules(text).allows(f"http://h.test{path}", user_agent)


def test_rfc9309_longest_match_wins() -> None:  # §2.2.2
    text = "User-agent: *\nDisallow: /a\nAllow: /a/b\nDisallow: /a/b/c\n"
    assert not allowed(text, "/a/x")
    assert allowed(text, "/a/b/x")
    assert not allowed(text, "/a/b/c/x")


def test_rfc9309_allow_wins_a_tie() -> None:  # §2.2.2: equivalent rules -> allow
    assert allowed("User-agent: *\nDisallow: /a\nAllow: /a\n", "/a")
    assert allowed("User-agent: *\nAllow: /a\nDisallow: /a\n", "/a")


def test_rfc9309_star_matches_any_sequence() -> None:  # §2.2.3
    text = "User-agent: *\nDisallow: /*.pdf\n"
    assert not allowed(text, "/docs/x.pdf") and not allowed(text, "/x.pdf?download=1")
    assert allowed(text, "/docs/x.html")


def test_rfc9309_dollar_anchors_the_end() -> None:  # §2.2.3
    text = "User-agent: *\nDisallow: /*.pdf$\n"
    assert not allowed(text, "/x.pdf")
    assert allowed(text, "/x.pdfx") and allowed(text, "/x.pdf?page=2")


def test_rfc9309_groups_of_one_product_token_are_merged() -> None:  # §2.2.1
    text = ("User-agent: crawlmesh\nDisallow: /a\n\nUser-agent: other\nDisallow: /\n\n"
            "User-agent: CrawlMesh\nDisallow: /b\n")
    assert not allowed(text, "/a") and not allowed(text, "/b")
    assert allowed(text, "/c")


def test_rfc9309_product_token_matches_exactly_case_insensitively() -> None:  # §2.2.1
    """Protego alone would apply ``crawl`` (a prefix of our token) and ``github`` (a word
    of our contact URL) to us: the wrapper gives it only an exact token, else ``*``."""
    prefix = "User-agent: crawl\nDisallow: /\n\nUser-agent: *\nDisallow: /star\n"
    assert allowed(prefix, "/x") and not allowed(prefix, "/star")
    assert allowed("User-agent: github\nDisallow: /\n", "/x")
    assert not allowed("User-agent: CRAWLMESH\nDisallow: /\n", "/x")
    assert rules("User-agent: crawlmesh\nCrawl-delay: 2\n").crawl_delay_s(UA) == 2.0
    assert rules("User-agent: crawl\nCrawl-delay: 2\n").crawl_delay_s(UA) is None


def test_rfc9309_star_group_when_no_group_names_us() -> None:  # §2.2.1
    text = "User-agent: otherbot\nDisallow: /\n\nUser-agent: *\nDisallow: /private\n"
    assert allowed(text, "/x") and not allowed(text, "/private/x")
    assert allowed("User-agent: otherbot\nDisallow: /\n", "/x")  # no group for us: all allowed


async def test_rfc9309_byte_order_mark_is_tolerated(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/robots.txt": (200, "text/plain", b"\xef\xbb\xbfUser-agent: *\nDisallow: /x\n"),
                  "/x": PAGE}
    page = page_of(await make_handler().handle(entry(site.url("/x")), delivery()))
    assert page.error == f"{ROBOTS_DISALLOWS} {site.url('/x')}"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410])
async def test_rfc9309_4xx_allows_everything(site: Site, make_handler: MakeHandler, status: int) -> None:
    site.pages = {"/robots.txt": (status, "text/plain", b"User-agent: *\nDisallow: /\n"), "/x": PAGE}
    assert page_of(await make_handler().handle(entry(site.url("/x")), delivery())).status == 200


@pytest.mark.parametrize("status", [500, 502, 503, 429])
async def test_rfc9309_5xx_disallows_for_now_and_is_retried(
    site: Site, make_handler: MakeHandler, status: int,
) -> None:
    site.pages = {"/robots.txt": (status, "text/plain", b""), "/x": PAGE}
    handler = make_handler(robots_error_ttl_s=0.2)
    page = page_of(await handler.handle(entry(site.url("/x")), delivery()))
    assert page.error is not None and page.error.startswith(ROBOTS_DISALLOWS)
    site.pages["/robots.txt"] = (200, "text/plain", b"User-agent: *\nAllow: /\n")
    await asyncio.sleep(0.3)
    assert page_of(await handler.handle(entry(site.url("/x")), delivery())).status == 200
    assert site.requests.count("/robots.txt") == 2


def test_rfc9309_parse_limit_is_500_kib_by_default() -> None:  # §2.5
    assert FetcherSettings().robots_max_bytes == 500 * 1024
    assert FetcherSettings().robots_max_redirects == 5  # §2.3.1.2


async def test_rfc9309_line_cut_by_the_parse_limit_is_dropped(
    site: Site, make_handler: MakeHandler,
) -> None:
    text = b"User-agent: *\nDisallow: /private-area\n" + b"# pad\n" * 20 + b"Disallow: /privileged\n"
    cut_at = text.index(b"/privileged") + len(b"/priv")  # the limit falls inside that line
    site.pages = {"/robots.txt": (200, "text/plain", text), "/privacy": PAGE}
    handler = make_handler(robots_max_bytes=cut_at)
    # "Disallow: /priv" would wrongly cover /privacy: the half line is dropped
    assert page_of(await handler.handle(entry(site.url("/privacy")), delivery())).status == 200


async def test_product_token_and_contact_url_are_configurable(
    site: Site, make_handler: MakeHandler,
) -> None:
    seen: list[str] = []

    def record(req: BaseHTTPRequestHandler) -> None:
        seen.append(req.headers.get("User-Agent", ""))
        respond(req, 200, b"<html>x</html>")

    site.pages = {"/robots.txt": (200, "text/plain",
                                  b"User-agent: examplebot\nDisallow: /x\n\nUser-agent: *\nAllow: /\n")}
    site.routes["/y"] = record
    handler = make_handler(product_token="ExampleBot", contact_url="https://example.com/bot")
    page = page_of(await handler.handle(entry(site.url("/x")), delivery()))
    assert page.error == f"{ROBOTS_DISALLOWS} {site.url('/x')}"
    await handler.handle(entry(site.url("/y")), delivery())
    assert seen == ["ExampleBot/0.1 (+https://example.com/bot)"]
