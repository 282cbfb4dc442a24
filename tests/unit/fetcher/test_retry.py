"""The retry policy is data: which statuses and failures are transient, how many tries."""

from __future__ import annotations

from services.fetcher.retry import RETRY_HTTP_CODES, TRANSIENT_FAILURES, FailureKind, RetryPolicy
from services.fetcher.settings import FetcherSettings


def test_statuses() -> None:
    policy = RetryPolicy()
    assert all(policy.status_is_transient(s) for s in (429, 500, 502, 503, 504, 408))
    assert not any(policy.status_is_transient(s) for s in (200, 301, 400, 403, 404, 410, 501))
    assert FetcherSettings().retry_http_codes == frozenset(RETRY_HTTP_CODES)


def test_failures() -> None:
    assert TRANSIENT_FAILURES == {FailureKind.TIMEOUT, FailureKind.CONNECT, FailureKind.PROTOCOL,
                                  FailureKind.TRUNCATED}
    policy = RetryPolicy()
    assert not policy.failure_is_transient(FailureKind.DECODING)  # corrupt coding: permanent
    assert not policy.failure_is_transient(FailureKind.INVALID_URL)


def test_tries() -> None:
    policy = RetryPolicy(retries=2)
    assert [policy.may_retry(n) for n in (1, 2, 3)] == [True, True, False]
    assert not RetryPolicy(retries=0).may_retry(1)
