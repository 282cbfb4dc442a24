"""Which HTTP outcomes are retried, and how long a server asks us to wait.

The retryable statuses are data (:data:`RETRY_HTTP_CODES`, overridable in settings), as in
Scrapy's retry middleware; the handler applies them in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRY_HTTP_CODES: tuple[int, ...] = (500, 502, 503, 504, 522, 524, 408, 429)
"""Statuses worth another attempt (Scrapy's ``RETRY_HTTP_CODES``)."""


def retry_after_s(headers: Mapping[str, str], *, cap_s: float, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header, capped at ``cap_s``; None if absent.

    RFC 9110 §10.2.3: the value is either ``delay-seconds`` (a non-negative integer) or an
    ``HTTP-date``; a date in the past means 0. An unparseable value is ignored (None).

    Args:
        headers: response headers (case-insensitive mapping, e.g. ``httpx.Headers``).
        cap_s: ceiling in seconds, so one server cannot park a URL for days.
        now: the current time (UTC) for an HTTP-date; defaults to now.
    """
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), cap_s)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    delta = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(delta, 0.0), cap_s)
