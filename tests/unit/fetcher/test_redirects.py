"""Redirects and meta refreshes against real loopback sites: loops and bounds, odd
``Location`` values resolved as browsers do, same-host hops followed by hand, other hosts
handed back to dedup (a ``redirect`` links message and the page's result), never requested."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler

import pytest

from services.fetcher.downloader import resolve_location
from services.fetcher.handler import FetcherHandler
from shared import subjects
from shared.codec import decode, decompress, encode
from shared.contracts import DiscoveredLinks, FetchedPage, LinkOrigin, ParsedPage
from tests.sites import Site
from tests.unit.fetcher.conftest import JOB, TENANT, MakeHandler, delivery, entry, respond

HTML = b"<html><head><title>t</title></head><body>hello</body></html>"


async def fetch(handler: FetcherHandler, url: str) -> FetchedPage:
    (out,) = await handler.handle(entry(url), delivery())
    assert out.subject == subjects.fetched(TENANT, JOB)
    return decode(encode(out.message), FetchedPage)


def refresh_page(content: str) -> bytes:
    return (f'<html><head><meta http-equiv="Refresh" content="{content}"><title>r</title>'
            f"</head><body>moved</body></html>").encode()


def raw_redirect(location: bytes):  # type: ignore[no-untyped-def]
    """A route answering 302 with ``location`` written as raw bytes (e.g. UTF-8)."""
    def route(req: BaseHTTPRequestHandler) -> None:
        req.wfile.write(b"HTTP/1.0 302 Found\r\nContent-Length: 0\r\nLocation: " + location
                        + b"\r\n\r\n")
        req.close_connection = True
    return route


async def test_redirect_loop_is_detected(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/a"] = lambda req: respond(req, 302, Location="/b")
    site.routes["/b"] = lambda req: respond(req, 301, Location=site.url("/a"))
    page = await fetch(make_handler(max_redirects=10), site.url("/a"))
    assert page.status == 0
    assert page.error == f"redirect loop: {site.url('/b')} -> {site.url('/a')}"
    assert site.requests == ["/robots.txt", "/a", "/b"]  # each requested once


async def test_self_redirect_is_a_loop(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/s"] = lambda req: respond(req, 307, Location="/s")
    page = await fetch(make_handler(), site.url("/s"))
    assert page.error is not None and page.error.startswith("redirect loop")
    assert site.requests.count("/s") == 1


async def test_cross_host_redirect_goes_back_through_dedup(
    site: Site, other_site: Site, make_handler: MakeHandler,
) -> None:
    site.routes["/go"] = lambda req: respond(req, 301, Location=other_site.url("/there"))
    start = entry(site.url("/go"))
    links_out, page_out = await make_handler().handle(start, delivery())
    assert links_out.subject == subjects.links(TENANT, JOB)
    links = decode(encode(links_out.message), DiscoveredLinks)
    assert links.origin is LinkOrigin.REDIRECT
    assert [link.url for link in links.links] == [other_site.url("/there")]
    assert (links.source_url, links.source_fingerprint, links.depth) == (
        start.url, start.fingerprint, start.depth)
    assert page_out.subject == subjects.parsed(TENANT, JOB)
    page = decode(encode(page_out.message), ParsedPage)
    assert (page.status, page.url, page.final_url, page.error) == (
        301, start.url, other_site.url("/there"), None)
    assert other_site.requests == []  # not followed: not even its robots.txt


async def test_odd_locations_are_resolved_as_browsers_do(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/1"] = lambda req: respond(req, 302, Location="\\two\\step")  # backslashes
    site.routes["/two/step"] = lambda req: respond(req, 302, Location=" three four?q=a b ")
    site.routes["/two/three%20four"] = raw_redirect("/caf\u00e9/\u00fcber".encode())  # raw UTF-8
    site.routes["/caf%C3%A9/%C3%BCber"] = lambda req: respond(
        req, 302, Location="//" + site.base.split("//")[1] + "/end")  # scheme-relative
    site.pages = {"/end": (200, "text/html", HTML)}
    page = await fetch(make_handler(max_redirects=5), site.url("/1"))
    assert (page.status, page.final_url) == (200, site.url("/end"))
    assert site.requests == ["/robots.txt", "/1", "/two/step", "/two/three%20four?q=a+b",  # canonical query
                             "/caf%C3%A9/%C3%BCber", "/end"]


@pytest.mark.parametrize(("location", "expected"), [
    ("/a b", "http://h.test/a%20b"),
    ("//other.test/x", "http://other.test/x"),
    ("\\\\evil.test\\p?q=\\", "http://evil.test/p?q=%5C"),
    (" \t/caf\u00e9\n", "http://h.test/caf%C3%A9"),
    ("http:rel", "http://h.test/dir/rel"),
    ("../up", "http://h.test/up"),
    ("?only=query", "http://h.test/dir/page?only=query"),
    ("https://b\u00fccher.test/", "https://xn--bcher-kva.test/"),
])
def test_resolve_location(location: str, expected: str) -> None:
    assert resolve_location("http://h.test/dir/page", location) == expected


@pytest.mark.parametrize("location", ["mailto:someone@example.com", "http://[bad/", "javascript:void(0)"])
async def test_unusable_location_is_a_bad_redirect(
    site: Site, make_handler: MakeHandler, location: str,
) -> None:
    site.routes["/m"] = lambda req: respond(req, 302, Location=location)
    page = await fetch(make_handler(), site.url("/m"))
    assert page.status == 0 and page.error is not None and page.error.startswith("bad redirect")


async def test_redirect_without_location_is_the_answer(site: Site, make_handler: MakeHandler) -> None:
    site.routes["/n"] = lambda req: respond(req, 302)
    page = await fetch(make_handler(), site.url("/n"))
    assert (page.status, page.error, page.final_url) == (302, None, site.url("/n"))


async def test_meta_refresh_to_the_same_host_is_followed(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/old": (200, "text/html", refresh_page("0; url=/new page")),
                  "/new%20page": (200, "text/html", HTML)}
    page = await fetch(make_handler(), site.url("/old"))
    assert (page.status, page.final_url) == (200, site.url("/new%20page"))
    assert decompress(page.body, "zlib") == HTML
    assert site.requests == ["/robots.txt", "/old", "/new%20page"]


async def test_meta_refresh_to_another_host_goes_back_through_dedup(
    site: Site, other_site: Site, make_handler: MakeHandler,
) -> None:
    site.pages = {"/old": (200, "text/html", refresh_page(f"1;URL='{other_site.url('/x')}'"))}
    links_out, page_out = await make_handler().handle(entry(site.url("/old")), delivery())
    assert links_out.message.origin is LinkOrigin.REDIRECT
    assert [link.url for link in links_out.message.links] == [other_site.url("/x")]
    assert (page_out.message.status, page_out.message.final_url) == (200, other_site.url("/x"))
    assert other_site.requests == []


async def test_slow_meta_refresh_is_not_followed(site: Site, make_handler: MakeHandler) -> None:
    body = refresh_page("600; url=/elsewhere")
    site.pages = {"/p": (200, "text/html", body)}
    page = await fetch(make_handler(), site.url("/p"))
    assert (page.status, page.final_url) == (200, site.url("/p"))
    assert decompress(page.body, "zlib") == body


async def test_meta_refresh_loop_is_detected(site: Site, make_handler: MakeHandler) -> None:
    site.pages = {"/p": (200, "text/html", refresh_page("0; url=/p"))}
    page = await fetch(make_handler(), site.url("/p"))
    assert page.error is not None and page.error.startswith("redirect loop")


async def test_redirect_hops_across_hosts_count_towards_the_limit(
    site: Site, other_site: Site, make_handler: MakeHandler,
) -> None:
    """A chain that bounces between hosts went back through dedup at the same depth with no
    count, so it ran until the job's page budget was spent: the hops now travel with it."""
    site.routes["/a"] = lambda req: respond(req, 302, Location="/b")
    site.routes["/b"] = lambda req: respond(req, 302, Location=other_site.url("/c"))
    handler = make_handler(max_redirects=3)
    links_out, _ = await handler.handle(entry(site.url("/a")), delivery())
    links = decode(encode(links_out.message), DiscoveredLinks)
    assert links.redirects == 2  # /a -> /b here, /b -> other host

    arrived = entry(site.url("/a")).model_copy(update={"redirects": 2})
    site.requests.clear()
    (out,) = await handler.handle(arrived, delivery())  # one hop left: /a -> /b, no more
    page = decode(encode(out.message), FetchedPage)
    assert (page.status, page.error) == (0, "more than 3 redirects")
    assert site.requests == ["/a", "/b"] and other_site.requests == []
