"""What tenants send: crawl requests (or a bare URL) and what the seeder answers."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from shared.contracts.base import Contract, Token, UtcDatetime, utc_now

MAX_URL_CHARS = 2048
"""Longest URL accepted anywhere (a common browser and server limit)."""


def check_http_url(value: str) -> str:
    """Return ``value`` stripped if it is an absolute http(s) URL with a host.

    Raises:
        ValueError: saying why (scheme, host, length), for a clear rejection message.
    """
    url = value.strip()
    if not url:
        raise ValueError("empty URL")
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"URL longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"not a URL: {url!r} ({error})") from None
    if not parts.scheme:
        raise ValueError(f"not an absolute URL: {url!r} (expected http://host/... or https://...)")
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"unsupported scheme {parts.scheme!r} in {url!r}: only http and https")
    if not parts.hostname:
        raise ValueError(f"URL has no host: {url!r}")
    if port == 0:
        raise ValueError(f"URL has port 0: {url!r}")
    return url


class ScopeMode(StrEnum):
    """Which discovered links a job follows, relative to the seed they descend from."""

    SAME_HOST = "same-host"
    SAME_DOMAIN = "same-domain"  # registrable domain, by the public suffix list
    ANY = "any"


class Scope(Contract):
    """Scope of a crawl. ``allow``/``deny`` are Python regular expressions (``re.search``)."""

    mode: ScopeMode = ScopeMode.SAME_HOST
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @field_validator("allow", "deny")
    @classmethod
    def _compile(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"invalid pattern {pattern!r}: {error}") from None
        return patterns


class ExtractionRule(Contract):
    """A named CSS or XPath selector; results carry ``extracted[name]``."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    css: str | None = None
    xpath: str | None = None
    all: bool = Field(False, description="Every match (a list) instead of the first.")

    @model_validator(mode="after")
    def _one_selector(self) -> ExtractionRule:
        if (self.css is None) == (self.xpath is None):
            raise ValueError(f"rule {self.name!r} needs exactly one of css or xpath")
        return self


class CrawlRequest(Contract):
    """A crawl submitted on ``crawl.seeds.<tenant>``: JSON of this model, or a bare URL.

    Limits: ``max_depth`` hops from a seed (0 = seeds only); ``max_pages`` pages admitted
    per job; ``max_pages_per_host`` per host (0 = no cap).
    """

    schema_version: Literal[1] = 1
    seeds: tuple[str, ...] = Field(min_length=1, max_length=1000)
    job_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Client-chosen job id (optional)."
    )
    label: str | None = Field(None, max_length=200)
    scope: Scope = Scope()
    max_depth: int = Field(3, ge=0, le=100)
    max_pages: int = Field(10_000, ge=1, le=10_000_000)
    max_pages_per_host: int = Field(0, ge=0)
    rules: tuple[ExtractionRule, ...] = Field((), max_length=100)
    reply_to: str | None = Field(
        None, max_length=256, pattern=r"^_INBOX\.[A-Za-z0-9_.-]+$",
        description=(
            "Accepted and ignored: the seeder cannot answer into a tenant account's inbox; "
            "the started/rejected JobEvent on crawl.events.<job> is the answer."
        ),
    )

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(check_http_url(seed) for seed in seeds)


class SeedReply(Contract):
    """The seeder's answer to a submission that asked for one."""

    schema_version: Literal[1] = 1
    tenant: Token
    accepted: bool
    job_id: str | None = None
    reason: str | None = None


class JobState(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"


class JobCounters(Contract):
    """Hints about a job's progress (the per-URL state in KV is the truth)."""

    admitted: int = 0
    finished: int = 0
    failed: int = 0
    seeded: bool = False


class JobRecord(Contract):
    """A job as stored in the ``jobs`` KV bucket (key ``<tenant>.<job>``)."""

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    request: CrawlRequest
    state: JobState = JobState.RUNNING
    created_at: UtcDatetime = Field(default_factory=utc_now)
    finished_at: UtcDatetime | None = None
    counters: JobCounters | None = Field(None, description="Final totals, once not running.")
