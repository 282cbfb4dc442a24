"""Message contracts (pydantic v2, frozen, versioned). ``proto/`` is generated from these."""

from shared.contracts.base import Contract, utc_now
from shared.contracts.pages import (
    BodyRef,
    DiscoveredLinks,
    FetchedPage,
    FrontierEntry,
    LedgerEntry,
    Link,
    LinkOrigin,
    PageExpanded,
    ParsedPage,
)
from shared.contracts.requests import (
    CrawlRequest,
    ExtractionRule,
    JobCounters,
    JobRecord,
    JobState,
    Scope,
    ScopeMode,
    SeedReply,
    check_http_url,
)
from shared.contracts.results import DeadLetter, JobEvent, JobEventKind, Outcome, PageResult

MESSAGES: tuple[type[Contract], ...] = (
    CrawlRequest,
    SeedReply,
    JobRecord,
    DiscoveredLinks,
    FrontierEntry,
    FetchedPage,
    ParsedPage,
    PageExpanded,
    LedgerEntry,
    PageResult,
    JobEvent,
    DeadLetter,
)
"""Every top-level wire message; ``proto/schemas`` holds one JSON Schema for each."""

__all__ = [
    "MESSAGES",
    "BodyRef",
    "Contract",
    "CrawlRequest",
    "DeadLetter",
    "DiscoveredLinks",
    "ExtractionRule",
    "FetchedPage",
    "FrontierEntry",
    "JobCounters",
    "JobEvent",
    "JobEventKind",
    "JobRecord",
    "JobState",
    "LedgerEntry",
    "Link",
    "LinkOrigin",
    "Outcome",
    "PageExpanded",
    "PageResult",
    "ParsedPage",
    "Scope",
    "ScopeMode",
    "SeedReply",
    "check_http_url",
    "utc_now",
]
