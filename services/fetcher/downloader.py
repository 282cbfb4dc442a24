"""One HTTP GET, one hop: timeouts, the egress-guarded connection pool, a capped body.

Redirects are *not* followed here: the caller sees each 3xx and decides (so every hop is
checked against robots.txt and politeness; the egress policy applies at connect time).
:func:`location_of` and :func:`resolve_location` turn a ``Location`` into the next URL as
browsers do.

A body shorter than its ``Content-Length``, a chunked body cut before its last chunk, or a
compressed stream cut before its end marker is a :class:`FetchError` of kind
:attr:`~services.fetcher.retry.FailureKind.TRUNCATED`, never a page.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin

import httpcore
import httpx
from w3lib.url import safe_url_string

from services.fetcher.decoding import ACCEPT_ENCODING, BoundedDecoder, ContentDecodingError
from services.fetcher.egress import EgressPolicy, GuardedNetworkBackend
from services.fetcher.retry import FailureKind
from services.fetcher.settings import FetcherSettings
from shared.urls import UrlError

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
"""Statuses whose ``Location`` the fetcher follows (by hand, one hop at a time)."""

BodyWanted = Callable[[int, str | None], bool]
"""Given (status, media type or None), whether to read the body at all."""


class FetchError(Exception):
    """No usable response: connect or read failure, timeout, protocol or decoding error,
    truncated body; ``kind`` says which (the retry policy decides on it)."""

    def __init__(self, message: str, kind: FailureKind) -> None:
        super().__init__(message)
        self.kind = kind


_TAB_OR_NEWLINE = re.compile(r"[\t\n\r]")
_C0_OR_SPACE = "".join(chr(c) for c in range(0x21))


def location_of(headers: httpx.Headers) -> str | None:
    """The ``Location`` header as text: its bytes read as UTF-8 (as browsers do), else as
    ISO-8859-1; None when absent or blank."""
    for name, value in headers.raw:
        if name.lower() == b"location":
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError:
                text = value.decode("iso-8859-1")
            return text if text.strip(_C0_OR_SPACE) else None
    return None


def resolve_location(base: str, location: str) -> str:
    """The absolute URL a browser would go to for ``Location: location`` at ``base``.

    WHATWG URL §4.4 (basic URL parser): leading and trailing C0 controls and spaces are
    stripped, tabs and newlines removed, and for http(s) a backslash is a slash (before
    any ``?`` or ``#``: ``\\\\host\\p`` is ``//host/p``). The result is resolved against
    ``base`` (relative, scheme-relative, ``http:path``) and percent-encoded like a
    browser's address bar (spaces and non-ASCII in UTF-8, host in IDNA) by w3lib's
    ``safe_url_string``.

    Raises:
        UrlError: a ``Location`` no URL can be made of (e.g. ``http://[bad``).
    """
    location = _TAB_OR_NEWLINE.sub("", location.strip(_C0_OR_SPACE))
    cut = min((i for i in (location.find("?"), location.find("#")) if i >= 0), default=len(location))
    location = location[:cut].replace("\\", "/") + location[cut:]
    try:
        return safe_url_string(urljoin(base, location))
    except (ValueError, UnicodeError) as error:
        raise UrlError(f"invalid Location {location!r}: {error}") from None


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """What one GET produced.

    ``body`` is decoded (decompressed) and empty unless it was read; ``truncated`` says the
    body went past the cap and only its first ``max_bytes`` bytes were kept.
    ``media_type`` is the lower-cased ``Content-Type`` without parameters.
    """

    url: str
    status: int
    headers: httpx.Headers
    content_type: str | None
    media_type: str | None
    body: bytes
    truncated: bool
    elapsed_s: float


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a connection pool whose network backend is egress-guarded.

    httpx does not take a network backend, so the pool it builds is replaced by one built
    with :class:`~services.fetcher.egress.GuardedNetworkBackend` (same limits). Proxies and
    ``*_PROXY`` environment variables are not used: a proxy would hide the real peer.
    """

    def __init__(self, backend: httpcore.AsyncNetworkBackend, limits: httpx.Limits) -> None:
        super().__init__(limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=backend,
        )


class _Client(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` that never builds a redirect request.

    httpx builds the next request of every 3xx even with ``follow_redirects=False``, and
    raises on a ``Location`` it cannot parse (``mailto:x``, ``http://[bad``), losing the
    answer. Redirects are resolved by :func:`resolve_location` instead, so the (private)
    builder is replaced; ``response.next_request`` is then meaningless and unused.
    """

    def _build_redirect_request(self, request: httpx.Request, response: httpx.Response) -> httpx.Request:
        return request


def build_client(
    settings: FetcherSettings, policy: EgressPolicy,
    inner_backend: httpcore.AsyncNetworkBackend | None = None,
) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with the fetcher's timeouts, User-Agent and egress guard.

    ``inner_backend`` replaces httpcore's socket backend below the guard (tests count
    connection attempts with it).
    """
    limits = httpx.Limits(max_connections=settings.max_connections,
                          max_keepalive_connections=settings.max_connections // 2)
    timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
    transport = GuardedTransport(GuardedNetworkBackend(policy, inner_backend), limits)
    return _Client(
        transport=transport, timeout=timeout, follow_redirects=False, trust_env=False,
        headers={"User-Agent": settings.user_agent, "Accept-Encoding": ACCEPT_ENCODING},
    )


def detail_of(error: BaseException) -> str:
    """The first non-empty message along ``error``'s causes: httpx's ``ReadError`` for a
    connection reset mid-body says nothing itself (nor do httpcore's and anyio's errors
    under it); the ``ConnectionResetError`` at the bottom does."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            break
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return type(error).__name__


def _kind_of(error: Exception) -> FailureKind:
    """The :class:`FailureKind` of an httpx exception."""
    if isinstance(error, httpx.TimeoutException):
        return FailureKind.TIMEOUT
    if isinstance(error, httpx.ConnectError):
        return FailureKind.CONNECT
    if isinstance(error, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return FailureKind.INVALID_URL
    if isinstance(error, httpx.RemoteProtocolError) and (
            "incomplete" in str(error) or "without sending complete" in str(error)):
        return FailureKind.TRUNCATED
    return FailureKind.PROTOCOL


def _check_length(response: httpx.Response, received: int, url: str) -> None:
    """Raises FetchError (TRUNCATED) if fewer bytes came than ``Content-Length`` announced
    (h11 already refuses a short body when the peer closes; this also covers a proxy-less
    HTTP/1.0 server that just closes)."""
    declared = response.headers.get("content-length")
    if declared is None or not declared.strip().isdigit():
        return
    if received < int(declared):
        raise FetchError(f"truncated body fetching {url}: {received} of {declared} bytes",
                         FailureKind.TRUNCATED)


def media_type_of(content_type: str | None) -> str | None:
    """``text/html`` out of ``text/HTML; charset=utf-8``; None when absent or empty."""
    if not content_type:
        return None
    return content_type.split(";", 1)[0].strip().lower() or None


class Downloader:
    """Performs single-hop GETs with a total deadline per request (``total_timeout_s``)."""

    def __init__(self, client: httpx.AsyncClient, total_timeout_s: float) -> None:
        self.client = client
        self.total_timeout_s = total_timeout_s

    async def get(self, url: str, *, max_bytes: int, wanted: BodyWanted,
                  on_sent: Callable[[], None] | None = None) -> HttpResponse:
        """GET ``url`` without following redirects; read the body if ``wanted`` says so.

        The body is read as raw bytes and decoded by :class:`BoundedDecoder`, which stops
        at ``max_bytes`` decoded bytes and closes the connection. ``on_sent`` is called once
        the request's headers have been handed to the socket (httpcore's
        ``send_request_headers.complete`` trace event), after any connection set-up:
        politeness spaces the next request from there. Not from ``.started``: between the
        two the write yields to the event loop, and a busy loop would send the request
        later than the moment the next one is spaced from.

        Raises:
            FetchError: connection, timeout (connect, read or the total deadline of
                ``total_timeout_s`` seconds), protocol or content-decoding failure.
            services.fetcher.egress.EgressRefusedError: the host's address is refused.
        """
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.total_timeout_s):
                async with self.client.stream("GET", url, extensions=_trace(on_sent)) as response:
                    content_type = response.headers.get("content-type")
                    media_type = media_type_of(content_type)
                    body, truncated = b"", False
                    if wanted(response.status_code, media_type):
                        decoder = BoundedDecoder(response.headers.get("content-encoding"), max_bytes)
                        received = 0
                        async for chunk in response.aiter_raw():
                            received += len(chunk)
                            decoder.feed(chunk)
                            if decoder.truncated:
                                break
                        if not decoder.truncated:
                            _check_length(response, received, url)
                        body, truncated = decoder.finish(), decoder.truncated
        except TimeoutError:
            raise FetchError(f"timed out after {self.total_timeout_s}s fetching {url}",
                             FailureKind.TIMEOUT) from None
        except ContentDecodingError as error:
            kind = FailureKind.TRUNCATED if "truncated" in str(error) else FailureKind.DECODING
            raise FetchError(f"{type(error).__name__} fetching {url}: {error}", kind) from None
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            kind = _kind_of(error)
            what = "truncated body" if kind is FailureKind.TRUNCATED else type(error).__name__
            raise FetchError(f"{what} fetching {url}: {detail_of(error)}", kind) from None
        return HttpResponse(
            url=url, status=response.status_code, headers=response.headers,
            content_type=content_type, media_type=media_type, body=body, truncated=truncated,
            elapsed_s=time.perf_counter() - started,
        )


def _trace(on_sent: Callable[[], None] | None) -> dict[str, object]:
    """httpx request extensions calling ``on_sent`` when the request headers go out."""
    if on_sent is None:
        return {}

    async def trace(event: str, info: dict[str, object]) -> None:
        if event.endswith("send_request_headers.complete"):
            on_sent()

    return {"trace": trace}
