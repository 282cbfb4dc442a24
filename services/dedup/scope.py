"""Whether a canonical URL is in a job's scope: host or domain of its seeds, URL patterns.

``same-host`` compares ``host[:port]`` as in canonical URLs (default ports already dropped,
so ``http://a/`` and ``https://a/`` share a host; ``a:8080`` is another host). ``same-domain``
compares registrable domains by the public suffix list, private section included, so
``a.example.co.uk`` and ``b.example.co.uk`` match while ``alice.github.io`` and
``bob.github.io`` do not (the "site" of the URL Standard §3.1 / HTML §7.1.1). A host under
no listed suffix falls back to the list's default rule ``*`` (its last two labels); a host
that is itself a public suffix, a single label, or an IP address is its own domain. Ports
do not matter in same-domain mode.

The list is tldextract's bundled snapshot: looked up offline, never fetched.

Scope is relative to all of the job's seeds together (links do not carry their seed). The
seeds themselves are always in scope: a seed names what the tenant asked for, even when it
would fail its own job's allow pattern.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from urllib.parse import urlsplit

import tldextract

from shared import urls
from shared.contracts import CrawlRequest, ScopeMode
from shared.contracts.requests import MAX_URL_CHARS

OFF_HOST = "off-host"
OFF_DOMAIN = "off-domain"
DENIED = "denied by pattern"
NOT_ALLOWED = "not allowed by pattern"
TOO_LONG = "url too long"


@functools.cache
def _public_suffixes() -> tldextract.TLDExtract:
    # suffix_list_urls=() and cache_dir=None: the bundled snapshot only, no network, no disk.
    return tldextract.TLDExtract(
        suffix_list_urls=(), cache_dir=None, include_psl_private_domains=True
    )


def registrable_domain(host: str) -> str:
    """The registrable domain of ``host`` (a hostname or IP literal, without port).

    ``a.b.example.co.uk`` -> ``example.co.uk``; an IP address, a single label or a public
    suffix is returned as is (lower-cased); see the module docstring.
    """
    host = host.lower().rstrip(".").strip("[]")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    parts = _public_suffixes()(host)
    if parts.domain and parts.suffix:
        return f"{parts.domain}.{parts.suffix}"
    if not parts.suffix:  # no rule matched: the default rule "*" makes the last label public
        return ".".join(host.split(".")[-2:])
    return host  # the host is itself a public suffix


class JobScope:
    """A job's scope, compiled once per job from its :class:`CrawlRequest`.

    Args:
        request: the job's request (seeds, ``scope.mode``, ``scope.allow``/``deny``).
        max_url_chars: longest URL admitted (a crawl-trap limit).
    """

    def __init__(self, request: CrawlRequest, max_url_chars: int = MAX_URL_CHARS) -> None:
        self.mode = request.scope.mode
        self.max_url_chars = max_url_chars
        self.allow = tuple(re.compile(pattern) for pattern in request.scope.allow)
        self.deny = tuple(re.compile(pattern) for pattern in request.scope.deny)
        seeds: set[str] = set()
        for seed in request.seeds:
            try:
                seeds.add(urls.canonical_url(seed))
            except urls.UrlError:
                continue
        self.seeds = frozenset(seeds)
        self.hosts = frozenset(urls.host_of(seed) for seed in seeds)
        self.domains = frozenset(registrable_domain(_hostname(seed)) for seed in seeds)

    def check(self, canonical_url: str) -> str | None:
        """None if ``canonical_url`` is in scope, else a short reason (the module constants).

        Checks in order: length, host or domain, deny patterns, allow patterns (``re.search``
        on the whole canonical URL; with no allow patterns everything is allowed).
        """
        if len(canonical_url) > self.max_url_chars:
            return TOO_LONG
        if canonical_url in self.seeds:
            return None
        if self.mode is ScopeMode.SAME_HOST and urls.host_of(canonical_url) not in self.hosts:
            return OFF_HOST
        if self.mode is ScopeMode.SAME_DOMAIN \
                and registrable_domain(_hostname(canonical_url)) not in self.domains:
            return OFF_DOMAIN
        if any(pattern.search(canonical_url) for pattern in self.deny):
            return DENIED
        if self.allow and not any(pattern.search(canonical_url) for pattern in self.allow):
            return NOT_ALLOWED
        return None


def _hostname(url: str) -> str:
    return urlsplit(url).hostname or ""
