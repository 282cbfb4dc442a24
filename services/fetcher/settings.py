"""Fetcher settings, read from ``CRAWLMESH_FETCHER_*`` environment variables.

They sit beside :class:`shared.settings.MeshSettings` (``CRAWLMESH_*``), which the fetcher
also reads for the mesh-wide values (inline body limit, ``max_deliver``). Durations are
seconds (``*_s``), sizes bytes (``*_bytes``). Lists and maps are JSON in the environment,
e.g.::

    CRAWLMESH_FETCHER_HOST_DELAYS='{"127.0.0.*": 0, "*.example.com": 2.5}'
    CRAWLMESH_FETCHER_EGRESS_ALLOW='["127.0.0.0/8"]'
    CRAWLMESH_FETCHER_RETRY_HTTP_CODES='[500, 502, 503]'
"""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.fetcher.retry import RETRY_HTTP_CODES

HTML_CONTENT_TYPES: tuple[str, ...] = ("text/html", "application/xhtml+xml")
"""Media types whose bodies are downloaded (others are reported without a body)."""


class HostRule(BaseModel):
    """An operator's rule for the hosts matching one pattern (``host_rules``); a field left
    out keeps the default (``default_delay_s`` / ``host_delays``, ``default_max_in_flight``,
    ``crawl_delay_max_s``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    delay_s: float | None = Field(None, ge=0, description="Least gap between request starts.")
    max_in_flight: int | None = Field(None, ge=1, description="Requests in flight at once.")
    crawl_delay_max_s: float | None = Field(None, ge=0, description="Crawl-delay ceiling.")


class FetcherSettings(BaseSettings):
    """HTTP, robots.txt, politeness and egress settings of the fetcher.

    Raises:
        pydantic.ValidationError: on an invalid value (e.g. a malformed CIDR in
            ``egress_allow`` or a negative delay in ``host_delays``).
    """

    model_config = SettingsConfigDict(env_prefix="CRAWLMESH_FETCHER_", extra="ignore", frozen=True)

    # HTTP
    product_token: str = Field(
        "crawlmesh", pattern=r"^[a-zA-Z_-]+$",
        description="Our robots.txt product token (RFC 9309 §2.2.1); starts the default User-Agent.",
    )
    contact_url: str = Field(
        "https://github.com/crawlmesh/crawlmesh",
        description="Where site owners learn about the crawler and reach its operator.",
    )
    user_agent: str = Field(
        "",
        description="User-Agent header; default '<product_token>/0.1 (+<contact_url>)'. "
        "robots.txt groups are matched against its leading product token.",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="DNS + TCP (+ TLS) connect timeout.")
    read_timeout_s: float = Field(10.0, gt=0, description="Longest wait for any chunk of a response.")
    total_timeout_s: float = Field(30.0, gt=0, description="Whole request of one hop, body included.")
    max_redirects: int = Field(5, ge=0, description="Redirect hops followed (each one checked).")
    max_body_bytes: int = Field(10 << 20, gt=0, description="Cap on a body, after decompression.")
    html_content_types: tuple[str, ...] = HTML_CONTENT_TYPES
    max_connections: int = Field(100, ge=1, description="Open connections of the HTTP pool.")
    concurrency: int = Field(
        128, ge=1,
        description="Handlers at once (most wait for their host's turn); capped by max_ack_pending.",
    )

    # Retries (RETRY_HTTP_CODES is data, as in Scrapy's retry middleware)
    retry_http_codes: frozenset[int] = frozenset(RETRY_HTTP_CODES)
    http_retries: int = Field(2, ge=0, description="Retries of a retryable status or network error.")
    retry_after_max_s: float = Field(300.0, ge=0, description="Ceiling on a honoured Retry-After.")

    # Politeness
    default_delay_s: float = Field(1.0, ge=0, description="Pause between two requests to one host.")
    host_delays: dict[str, float] = Field(
        default_factory=dict,
        description="Glob on host or host:port -> delay (s); the first matching pattern wins.",
    )
    crawl_delay_max_s: float = Field(30.0, ge=0, description="Ceiling on a robots.txt Crawl-delay.")
    queue_horizon_s: float = Field(
        20.0, gt=0, description="Entries due later than this are re-published, not held.",
    )
    reschedule_hold_s: float = Field(
        5.0, ge=0,
        description="How long an entry re-published earlier, still not due, is held before "
        "being re-published again (stops a far-future entry from circulating in a hot loop).",
    )

    # robots.txt (RFC 9309)
    robots_ttl_s: float = Field(86400.0, gt=0, description="Cache life of a fetched robots.txt.")
    robots_error_ttl_s: float = Field(
        300.0, gt=0, description="Cache life of 'disallow all' after a 5xx or unreachable robots.txt.",
    )
    robots_max_bytes: int = Field(500 * 1024, gt=0, description="Parse cap (RFC 9309 §2.5).")
    robots_max_redirects: int = Field(5, ge=0, description="Redirects of robots.txt followed.")
    robots_cache_hosts: int = Field(10_000, ge=1, description="Origins kept in process memory.")

    # Egress
    egress_allow: tuple[IPv4Network | IPv6Network, ...] = Field(
        (), description="CIDRs exempt from the egress policy (e.g. 127.0.0.0/8 for tests).",
    )

    # ---- Shared politeness: partition leases and per-host budgets (issue 5) ---------------
    # Every host has ONE budget for the whole mesh (all fetchers, tenants and jobs): its
    # frontier partition is served by the one fetcher holding that partition's lease, and
    # its next-due time, Retry-After pause and slow-down factor live in the ``hosts`` KV
    # bucket, so a new owner honours them.
    #
    # The rule in force for a host (first matching ``host_rules`` pattern, else
    # ``host_delays``, else the defaults):
    # - request starts are at least ``delay`` apart, with at most ``max_in_flight`` requests
    #   in flight; with 1 in flight the host also rests ``delay`` after each request ends;
    # - ``delay`` is at least robots.txt's Crawl-delay; a Crawl-delay above the ceiling is
    #   still honoured, but the host's entries are always deferred (re-published for their
    #   due time), never held waiting nor fetched faster than the site asked;
    # - Retry-After on 429/503 pauses the whole host (capped at ``retry_after_max_s``);
    # - adaptive slow-down: the delay is multiplied by the host's factor f (1 <= f <=
    #   ``adaptive_max_factor``); f doubles after a request that fails (network error, 5xx,
    #   429) or takes longer than ``adaptive_slow_s``, and is multiplied by
    #   ``adaptive_recovery`` (back towards 1) after each fast success. A host whose delay
    #   is 0 gets ``adaptive_floor_s`` x f while f > 1.
    lease_s: float = Field(
        5.0, ge=0.5,
        description="Partition lease period; renewed every third of it. A crashed fetcher's "
        "partitions are taken over about 1.5 lease periods after its last renewal.",
    )
    partition_slots: int = Field(
        32, ge=1, description="Handlers at once per owned partition (capped by max_ack_pending).",
    )
    default_max_in_flight: int = Field(1, ge=1, description="Requests in flight per host.")
    host_rules: dict[str, HostRule] = Field(
        default_factory=dict,
        description="Operator overrides: glob on host or host:port -> rule; first match wins, "
        'e.g. {"127.0.0.*": {"delay_s": 0.02, "max_in_flight": 4}}.',
    )
    adaptive_slow_s: float = Field(2.0, gt=0, description="A response slower than this slows the host.")
    adaptive_max_factor: float = Field(8.0, ge=1, description="Most a host's delay is multiplied by.")
    adaptive_recovery: float = Field(0.8, gt=0, le=1, description="Factor shrink per fast success.")
    adaptive_floor_s: float = Field(0.25, ge=0, description="Base of a slowed zero-delay host.")

    @field_validator("host_rules")
    @classmethod
    def _lower_rules(cls, rules: dict[str, HostRule]) -> dict[str, HostRule]:
        return {pattern.lower(): rule for pattern, rule in rules.items()}

    # ---- end of the shared politeness section --------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _default_user_agent(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("user_agent"):
            token = data.get("product_token") or cls.model_fields["product_token"].default
            contact = data.get("contact_url") or cls.model_fields["contact_url"].default
            data = {**data, "user_agent": f"{token}/0.1 (+{contact})"}
        return data

    @field_validator("host_delays")
    @classmethod
    def _non_negative(cls, delays: dict[str, float]) -> dict[str, float]:
        for pattern, delay in delays.items():
            if delay < 0:
                raise ValueError(f"delay of {pattern!r} is negative: {delay}")
        return {pattern.lower(): delay for pattern, delay in delays.items()}

    @field_validator("html_content_types")
    @classmethod
    def _lower(cls, types: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(t.strip().lower() for t in types)
