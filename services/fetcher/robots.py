"""robots.txt: fetched once per origin, cached in process and in a shared store, obeyed.

Rules follow RFC 9309 (the Robots Exclusion Protocol); matching is Protego's (longest
match wins, Allow wins a tie, ``*`` and ``$``, groups of one product token merged, §2.2),
with one wrapper (:meth:`RobotsRules.agent_for`): Protego applies a group whose name is a
*prefix* of, or any word in, the User-Agent it is given (``User-agent: crawl`` would apply
to ``crawlmesh/0.1 (+https://github.com/...)``, and so would ``User-agent: github``). Per
§2.2.1 the group is the one whose name equals our product token (case-insensitively);
without one, the ``*`` group. Our product token is the leading product name of the
configured ``user_agent`` (``crawlmesh`` in ``crawlmesh/0.1 (+<contact URL>)``).

* §2.1 a byte-order mark at the start of the file is ignored.

* §2.3.1.1 a 2xx answer is parsed; only the first ``robots_max_bytes`` (500 KiB, §2.5)
  are read, and a line cut by that limit is dropped (half a path would be another rule).
* §2.3.1.2 redirects are followed up to ``robots_max_redirects`` (5) hops, even to other
  origins; beyond that the file counts as unavailable.
* §2.3.1.3 a 4xx answer ("unavailable") allows everything. Exception: 429 Too Many
  Requests is treated as unreachable (a server asking us to slow down is not saying
  "crawl anything"), as major crawlers do.
* §2.3.1.4 a 5xx answer or a network failure ("unreachable") disallows everything, for
  now: cached only ``robots_error_ttl_s`` so it is retried soon.
* §2.4 a fetched file is cached at most ``robots_ttl_s`` (24 h).

An origin is ``scheme://host:port``. The cache is an in-process LRU in front of a
:class:`RobotsStore` (the ``robots`` KV bucket in production) so fetchers share what one
of them fetched; store failures only cost a refetch. Concurrent lookups of one origin
share one fetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Protocol
from urllib.parse import urlsplit

import orjson
from protego import Protego

from services.fetcher.downloader import (
    REDIRECT_STATUSES,
    Downloader,
    FetchError,
    location_of,
    resolve_location,
)
from services.fetcher.egress import EgressRefusedError
from services.fetcher.settings import FetcherSettings
from shared.urls import UrlError

log = logging.getLogger(__name__)

_KEY_SAFE = re.compile(r"^[-_=.a-zA-Z0-9]+$")
_PRODUCT_TOKEN = re.compile(r"[a-zA-Z_-]+")
_GROUP_NAME = re.compile(r"^[ \t]*user-agent[ \t]*:[ \t]*([^#\s]*)", re.IGNORECASE | re.MULTILINE)


def product_token(user_agent: str) -> str:
    """The product token of a User-Agent (RFC 9309 §2.2.1: ``[a-zA-Z_-]+``), lower-cased:
    ``crawlmesh`` out of ``crawlmesh/0.1 (+https://example.com/bot)``; "" if none."""
    found = _PRODUCT_TOKEN.match(user_agent.strip())
    return found.group(0).lower() if found else ""


class RobotsStore(Protocol):
    """Shared robots.txt records by key (values are opaque bytes; the store may expire them)."""

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes) -> None: ...


class RobotsVerdict(StrEnum):
    RULES = "rules"  # a parsed robots.txt
    ALLOW_ALL = "allow_all"  # unavailable (4xx), RFC 9309 §2.3.1.3
    DISALLOW_ALL = "disallow_all"  # unreachable (5xx, network), RFC 9309 §2.3.1.4


@dataclass(frozen=True)
class RobotsRules:
    """What robots.txt says for one origin, valid until ``expires_at`` (epoch seconds).

    ``status`` is the HTTP status of the last hop (0 when unreachable); ``note`` says why
    a file was not used (e.g. ``robots.txt unreachable: HTTP 503``).
    """

    verdict: RobotsVerdict
    expires_at: float
    status: int = 0
    text: str = field(default="", repr=False)
    note: str = ""

    @cached_property
    def _parser(self) -> Protego:
        return Protego.parse(self.text)

    @cached_property
    def _group_names(self) -> frozenset[str]:
        return frozenset(name.lower() for name in _GROUP_NAME.findall(self.text))

    def agent_for(self, user_agent: str) -> str:
        """What to give Protego for ``user_agent``: its product token if a group has exactly
        that name, else ``*`` (so only the ``*`` group, if any, applies; module docstring)."""
        token = product_token(user_agent)
        return token if token and token in self._group_names else "*"

    def allows(self, url: str, user_agent: str) -> bool:
        """Whether ``user_agent`` (a User-Agent or its product token) may fetch ``url``
        (robots.txt itself is always allowed)."""
        if self.verdict is RobotsVerdict.ALLOW_ALL:
            return True
        if self.verdict is RobotsVerdict.DISALLOW_ALL:
            return urlsplit(url).path == "/robots.txt"
        return self._parser.can_fetch(url, self.agent_for(user_agent))

    def crawl_delay_s(self, user_agent: str) -> float | None:
        """The ``Crawl-delay`` of the group matching ``user_agent``, in seconds, if any."""
        if self.verdict is not RobotsVerdict.RULES:
            return None
        return self._parser.crawl_delay(self.agent_for(user_agent))

    def to_bytes(self) -> bytes:
        return orjson.dumps({"verdict": self.verdict, "expires_at": self.expires_at,
                             "status": self.status, "text": self.text, "note": self.note})

    @classmethod
    def from_bytes(cls, data: bytes) -> RobotsRules:
        """Raises: ValueError (incl. orjson.JSONDecodeError), KeyError on a bad record."""
        raw = orjson.loads(data)
        return cls(RobotsVerdict(raw["verdict"]), float(raw["expires_at"]), int(raw["status"]),
                   str(raw["text"]), str(raw.get("note", "")))


def origin_of(url: str) -> str:
    """``scheme://host:port`` of ``url``, with the default port made explicit."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    host = (parts.hostname or "").lower()
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port}"


def store_key(origin: str) -> str:
    """A KV-safe key for ``origin``: ``<scheme>.<port>.<host>`` (``:`` of IPv6 as ``_``)."""
    parts = urlsplit(origin)
    host = (parts.hostname or "").replace(":", "_")
    key = f"{parts.scheme}.{parts.port}.{host}"
    if not _KEY_SAFE.match(key):
        key = f"{parts.scheme}.{parts.port}.x-{host.encode().hex()}"
    return key


class RobotsCache:
    """robots.txt rules per origin (see module docstring).

    Args:
        downloader: performs the robots.txt GETs (egress-guarded).
        store: the shared store behind the in-process cache.
        settings: ``robots_*`` limits and TTLs.
        clock: epoch seconds (tests may pass their own).
    """

    def __init__(self, downloader: Downloader, store: RobotsStore, settings: FetcherSettings,
                 clock: Callable[[], float] = time.time) -> None:
        self.downloader = downloader
        self.store = store
        self.settings = settings
        self.clock = clock
        self._cache: OrderedDict[str, RobotsRules] = OrderedDict()
        self._loading: dict[str, asyncio.Task[RobotsRules]] = {}

    async def rules_for(self, url: str) -> RobotsRules:
        """The robots.txt rules of ``url``'s origin, fetching them at most once at a time.

        Raises:
            EgressRefusedError: the origin's own address is refused by the egress policy
                (the URL cannot be fetched either; nothing is cached).
        """
        origin = origin_of(url)
        rules = self._cache.get(origin)
        if rules is not None and rules.expires_at > self.clock():
            self._cache.move_to_end(origin)
            return rules
        task = self._loading.get(origin)
        if task is None:
            task = asyncio.create_task(self._load(origin))
            self._loading[origin] = task
            task.add_done_callback(lambda t: self._loaded(origin, t))
        return await asyncio.shield(task)

    def _loaded(self, origin: str, task: asyncio.Task[RobotsRules]) -> None:
        self._loading.pop(origin, None)
        if task.cancelled() or task.exception() is not None:
            return
        self._cache[origin] = task.result()
        self._cache.move_to_end(origin)
        while len(self._cache) > self.settings.robots_cache_hosts:
            self._cache.popitem(last=False)

    async def _load(self, origin: str) -> RobotsRules:
        key = store_key(origin)
        try:
            stored = await self.store.get(key)
            if stored is not None:
                rules = RobotsRules.from_bytes(stored)
                if rules.expires_at > self.clock():
                    return rules
        except Exception as error:  # a store hiccup costs a refetch, nothing more
            log.warning("robots store read of %s failed: %r", key, error)
        rules = await self.fetch(origin)
        try:
            await self.store.put(key, rules.to_bytes())
        except Exception as error:
            log.warning("robots store write of %s failed: %r", key, error)
        return rules

    async def fetch(self, origin: str) -> RobotsRules:
        """Fetch and classify ``origin``'s robots.txt (RFC 9309 §2.3.1, module docstring).

        Raises:
            EgressRefusedError: the origin itself is refused (a refused redirect hop
                counts as unreachable instead).
        """
        url = f"{origin}/robots.txt"
        settings = self.settings
        for hop in range(settings.robots_max_redirects + 1):
            try:
                response = await self.downloader.get(
                    url, max_bytes=settings.robots_max_bytes,
                    wanted=lambda status, _media: 200 <= status < 300,
                )
            except EgressRefusedError as refused:
                if hop == 0:
                    raise
                return self._rules(RobotsVerdict.DISALLOW_ALL, 0,
                                   note=f"robots.txt unreachable: {refused.describe(url)}")
            except FetchError as error:
                log.info("robots.txt of %s unreachable: %s", origin, error)
                return self._rules(RobotsVerdict.DISALLOW_ALL, 0,
                                   note=f"robots.txt unreachable: {error}")
            status = response.status
            location = location_of(response.headers)
            if status in REDIRECT_STATUSES and location is not None:
                try:
                    url = resolve_location(url, location)
                except UrlError:
                    return self._rules(RobotsVerdict.ALLOW_ALL, status,
                                       note=f"bad redirect to {location!r}")
                if urlsplit(url).scheme not in ("http", "https"):
                    return self._rules(RobotsVerdict.ALLOW_ALL, status, note=f"redirect to {url}")
                continue
            if 200 <= status < 300:
                body = response.body
                if response.truncated:  # a line cut by the parse limit is dropped
                    body = body[:body.rfind(b"\n") + 1]
                text = body.decode("utf-8-sig", errors="replace")
                return self._rules(RobotsVerdict.RULES, status, text=text)
            if status == 429 or status >= 500:
                return self._rules(RobotsVerdict.DISALLOW_ALL, status,
                                   note=f"robots.txt unreachable: HTTP {status}")
            return self._rules(RobotsVerdict.ALLOW_ALL, status, note=f"robots.txt HTTP {status}")
        return self._rules(RobotsVerdict.ALLOW_ALL, 0, note="robots.txt redirects too often")

    def _rules(self, verdict: RobotsVerdict, status: int, *, text: str = "",
               note: str = "") -> RobotsRules:
        ttl = (self.settings.robots_error_ttl_s if verdict is RobotsVerdict.DISALLOW_ALL
               else self.settings.robots_ttl_s)
        return RobotsRules(verdict, self.clock() + ttl, status, text, note)

    async def aclose(self) -> None:
        """Cancel lookups still running (at shutdown)."""
        for task in list(self._loading.values()):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
