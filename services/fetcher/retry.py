"""The retry policy, as data: which outcomes are transient (retried with backoff) and which
are permanent (reported at once as a result carrying the error).

* Statuses: :data:`RETRY_HTTP_CODES` (Scrapy's ``RETRY_HTTP_CODES``; overridable with
  ``CRAWLMESH_FETCHER_RETRY_HTTP_CODES``) are transient; every other status is an answer,
  reported as it is (a 404 is a result, not an error).
* Failures without an answer, by :class:`FailureKind`: those in
  :data:`TRANSIENT_FAILURES` (timeouts, connection failures, protocol errors, bodies cut
  short) are transient; the others (a corrupt or unsupported content coding, an invalid
  URL) would fail the same way again and are permanent.
* A transient outcome is retried while ``delivery.delivered <= http_retries``; the wait
  before the next try is the server's ``Retry-After`` (:func:`retry_after_s`, capped) if it
  sent one, else the consumer's backoff schedule (``CRAWLMESH_BACKOFF_S``). After the last
  retry it is reported like a permanent one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum

RETRY_HTTP_CODES: tuple[int, ...] = (500, 502, 503, 504, 522, 524, 408, 429)
"""Statuses worth another attempt (Scrapy's ``RETRY_HTTP_CODES``)."""


class FailureKind(StrEnum):
    """Why a request got no usable answer."""

    TIMEOUT = "timeout"  # connect, read or total deadline
    CONNECT = "connect"  # DNS, refused, reset before an answer
    PROTOCOL = "protocol"  # malformed HTTP, connection closed mid-answer
    TRUNCATED = "truncated"  # fewer bytes than Content-Length, chunked or compressed stream cut
    DECODING = "decoding"  # corrupt or unsupported Content-Encoding
    INVALID_URL = "invalid_url"  # httpx refuses the URL


TRANSIENT_FAILURES: frozenset[FailureKind] = frozenset(
    {FailureKind.TIMEOUT, FailureKind.CONNECT, FailureKind.PROTOCOL, FailureKind.TRUNCATED}
)
"""Failures retried (with backoff) before being reported; the others are reported at once."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The policy above for one fetcher (``retries``: retries after the first try)."""

    statuses: frozenset[int] = frozenset(RETRY_HTTP_CODES)
    failures: frozenset[FailureKind] = TRANSIENT_FAILURES
    retries: int = 2

    def status_is_transient(self, status: int) -> bool:
        return status in self.statuses

    def failure_is_transient(self, kind: FailureKind) -> bool:
        return kind in self.failures

    def may_retry(self, delivered: int) -> bool:
        """Whether the ``delivered``-th try (1-based) may still be followed by another."""
        return delivered <= self.retries


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
