"""Outlinks of a parsed page: resolved against the document base URL, followable, unique.

URLs resolve (RFC 3986 §5) against the document base URL (WHATWG HTML, "document base
URL" and the ``base`` element): the ``href`` of the first ``<base>`` element that has one,
itself resolved against the page URL (so a relative ``<base href="../">`` works), or the
page URL. ``rel`` is a set of space-separated, case-insensitive tokens (HTML §4.6.7, link
types); ``nofollow`` is kept on the link, and a page-wide
``<meta name="robots" content="nofollow">`` marks every link.
"""

from __future__ import annotations

from urllib.parse import urljoin, urlsplit, urlunsplit

import orjson
from parsel import Selector

from shared.contracts import Link
from shared.contracts.requests import MAX_URL_CHARS

FOLLOWABLE_SCHEMES = frozenset({"http", "https"})
"""Link schemes kept; ``mailto:``, ``javascript:``, ``tel:``, ``data:`` and the rest are dropped."""

LINK_TAGS = ("a", "area")
"""Elements whose ``href`` is an outlink (HTML §4.6.2, links created by a and area)."""

LINK_JSON_OVERHEAD_BYTES = len(b'{"url":,"nofollow":false},')
"""JSON bytes a link takes in a message besides its URL."""


def resolve(base: str, href: str) -> str | None:
    """``href`` made absolute against ``base``, fragment removed; None unless http(s).

    Leading and trailing whitespace is stripped (as HTML does); URLs longer than
    :data:`MAX_URL_CHARS` are dropped, since no stage accepts them.
    """
    try:
        parts = urlsplit(urljoin(base, href.strip()))
        if parts.scheme not in FOLLOWABLE_SCHEMES or not parts.hostname:
            return None
        _ = parts.port  # raises ValueError for a port that is not a number in 0..65535
        url = urlunsplit(parts._replace(fragment=""))
    except ValueError:  # an invalid IPv6 literal or port
        return None
    return url if len(url) <= MAX_URL_CHARS else None


def document_base(selector: Selector, page_url: str) -> str:
    """The document base URL: the first ``<base href>`` resolved against ``page_url``.

    A base that does not resolve to an http(s) URL is ignored, as is a missing one.
    """
    for base in selector.root.iter("base"):
        href = base.get("href")
        if href is not None:
            try:
                url = urljoin(page_url, href.strip())
                usable = urlsplit(url).scheme in FOLLOWABLE_SCHEMES
            except ValueError:
                usable = False
            return url if usable else page_url
    return page_url


def outlinks(
    selector: Selector, base: str, *, page_nofollow: bool = False,
    max_links: int = 10_000, budget_bytes: int = 768 << 10,
) -> tuple[Link, ...]:
    """Links of ``<a href>`` and ``<area href>``, in page order, each URL once.

    A URL found both with and without ``rel=nofollow`` is followable. Collection stops at
    ``max_links`` URLs or when their JSON would exceed ``budget_bytes``.
    """
    found: dict[str, bool] = {}  # url -> nofollow, in insertion (page) order
    used_bytes = 0
    for element in selector.root.iter(*LINK_TAGS):
        href = element.get("href")
        if href is None:
            continue
        url = resolve(base, href)
        if url is None:
            continue
        nofollow = page_nofollow or "nofollow" in (element.get("rel") or "").lower().split()
        if url in found:
            found[url] = found[url] and nofollow
            continue
        cost = len(orjson.dumps(url)) + LINK_JSON_OVERHEAD_BYTES
        if len(found) >= max_links or used_bytes + cost > budget_bytes:
            break
        used_bytes += cost
        found[url] = nofollow
    return tuple(Link(url=url, nofollow=nofollow) for url, nofollow in found.items())
