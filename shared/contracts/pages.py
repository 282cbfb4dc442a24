"""Messages between stages: links, frontier entries, fetched and parsed pages."""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from shared.contracts.base import Contract, Token, UtcDatetime, utc_now


class Link(Contract):
    """One outlink as found on a page (absolute URL, not yet canonical)."""

    url: str
    nofollow: bool = False


class LinkOrigin(StrEnum):
    SEED = "seed"
    OUTLINKS = "outlinks"
    REDIRECT = "redirect"


class DiscoveredLinks(Contract):
    """Links for dedup (``mesh.links.<tenant>.<job>``): seeds, a page's outlinks, a redirect.

    ``depth`` is the depth the links would have (source depth + 1; 0 for seeds).
    ``source_fingerprint`` is None for seeds.
    """

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    origin: LinkOrigin
    depth: int = Field(ge=0)
    source_url: str | None = None
    source_fingerprint: str | None = None
    links: tuple[Link, ...]
    part: int = Field(0, ge=0, description="Index of this message when links are split.")
    parts: int = Field(1, ge=1, description="How many messages the links were split into.")
    redirects: int = Field(
        0, ge=0, description="Redirect hops already followed to reach these links (origin "
        "redirect: a chain across hosts counts towards the fetcher's max_redirects); else 0.")


class FrontierEntry(Contract):
    """An admitted URL for the fetcher (``mesh.frontier.<partition>.<tenant>.<job>``)."""

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    url: str = Field(description="Canonical URL.")
    fingerprint: str
    host: str
    depth: int = Field(ge=0)
    generation: int = Field(0, ge=0)
    redirects: int = Field(
        0, ge=0, description="Redirect hops (across hosts) that led to this URL.")
    not_before: UtcDatetime | None = None
    admitted_at: UtcDatetime = Field(default_factory=utc_now)


class BodyRef(Contract):
    """Where a large body lives: an object in the tenant's Object Store bucket."""

    bucket: str
    name: str
    stored_bytes: int = Field(ge=0)


class FetchedPage(Contract):
    """A fetch outcome (``mesh.fetched.<tenant>.<job>``).

    The body travels out of band (``BINARY_FIELD``): raw bytes compressed per
    ``body_encoding``, or, when larger than the inline limit, in the Object Store
    (``body_ref``). ``body_bytes`` is the decompressed size. ``error`` is set when no HTTP
    response was obtained or it was refused (robots, egress, size); ``status`` is 0 then.
    """

    BINARY_FIELD: ClassVar[str | None] = "body"
    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    url: str
    final_url: str
    fingerprint: str
    depth: int = Field(ge=0)
    status: int = Field(ge=0, le=999)
    content_type: str | None = None
    fetched_at: UtcDatetime = Field(default_factory=utc_now)
    elapsed_ms: float = Field(0.0, ge=0)
    body_bytes: int = Field(0, ge=0)
    body_encoding: Literal["identity", "zlib"] = "identity"
    body: bytes = b""
    body_ref: BodyRef | None = None
    error: str | None = None


class ParsedPage(Contract):
    """A parsed page for the sink (``mesh.parsed.<tenant>.<job>``)."""

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    url: str
    final_url: str
    fingerprint: str
    depth: int = Field(ge=0)
    status: int
    content_type: str | None = None
    fetched_at: UtcDatetime
    title: str | None = None
    description: str | None = None
    canonical_url: str | None = None
    links_found: int = Field(0, ge=0)
    extracted: dict[str, str | list[str] | None] = Field(default_factory=dict)
    error: str | None = None


class PageExpanded(Contract):
    """Dedup's report that a page's outlinks were admitted or rejected (for completion).

    Sent once per page (``mesh.expanded.<tenant>.<job>``); ``admitted`` new frontier entries
    now belong to the job, so the job cannot complete before they finish.
    """

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    fingerprint: str | None = Field(description="Page whose links these were; None for seeds.")
    links_seen: int = Field(ge=0)
    admitted: int = Field(ge=0)
    admitted_fingerprints: tuple[str, ...] = ()


class LedgerEntry(Contract):
    """One completion-ledger entry (``mesh.ledger.<tenant>.<job>.<kind>``), one per page and
    kind; the server's per-subject counts of these are the job's counters."""

    schema_version: Literal[1] = 1
    tenant: Token
    job_id: Token
    kind: Literal["admitted", "finished", "failed", "seeded"]
    fingerprint: str | None = None
