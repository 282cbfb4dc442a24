"""Handler outcomes decided in one place: ack, nak with delay, dead letter."""

from __future__ import annotations

import pytest

from shared.bus.outcomes import (
    Outcome,
    TransientError,
    UnprocessableError,
    Verdict,
    decide,
    describe_error,
)
from shared.codec import DecodeError

BACKOFF = (2.0, 5.0, 15.0)
MAX_DELIVER = 5


def test_success_is_acked_on_any_delivery() -> None:
    for delivered in (1, MAX_DELIVER, MAX_DELIVER + 3):
        assert decide(None, delivered, MAX_DELIVER, BACKOFF) == Outcome(Verdict.ACK)


@pytest.mark.parametrize(
    "error",
    [UnprocessableError("no such job"), DecodeError("invalid JSON for DiscoveredLinks: x")],
)
def test_unprocessable_and_invalid_payloads_are_dead_lettered_at_once(
    error: Exception,
) -> None:
    outcome = decide(error, 1, MAX_DELIVER, BACKOFF)
    assert outcome.verdict is Verdict.DEAD_LETTER
    assert outcome.reason == str(error)
    # Even when deliveries are unlimited (the dlq-advisor consumer).
    assert decide(error, 1, -1, BACKOFF).verdict is Verdict.DEAD_LETTER


@pytest.mark.parametrize(("delivered", "delay_s"), [(1, 2.0), (2, 5.0), (3, 15.0), (4, 15.0)])
def test_transient_errors_are_nakd_on_the_backoff_schedule(delivered: int, delay_s: float) -> None:
    outcome = decide(TransientError("503 from upstream"), delivered, MAX_DELIVER, BACKOFF)
    assert outcome == Outcome(Verdict.NAK, delay_s=delay_s, reason="503 from upstream")


def test_transient_error_retry_after_overrides_the_schedule() -> None:
    outcome = decide(TransientError("slow down", retry_after_s=42.0), 1, MAX_DELIVER, BACKOFF)
    assert (outcome.verdict, outcome.delay_s) == (Verdict.NAK, 42.0)
    zero = decide(TransientError("now", retry_after_s=0.0), 2, MAX_DELIVER, BACKOFF)
    assert (zero.verdict, zero.delay_s) == (Verdict.NAK, 0.0)


def test_unexpected_exceptions_are_retried_with_their_type_in_the_reason() -> None:
    outcome = decide(KeyError("url"), 2, MAX_DELIVER, BACKOFF)
    assert outcome == Outcome(Verdict.NAK, delay_s=5.0, reason="KeyError: 'url'")


@pytest.mark.parametrize("error", [TransientError("still down"), RuntimeError("boom")])
def test_the_last_delivery_is_dead_lettered(error: Exception) -> None:
    outcome = decide(error, MAX_DELIVER, MAX_DELIVER, BACKOFF)
    assert outcome.verdict is Verdict.DEAD_LETTER
    assert outcome.reason.startswith(f"gave up after {MAX_DELIVER} deliveries: ")
    assert str(error) in outcome.reason
    # A delivery past max_deliver (e.g. settings lowered meanwhile) is dead-lettered too.
    assert decide(error, MAX_DELIVER + 1, MAX_DELIVER, BACKOFF).verdict is Verdict.DEAD_LETTER
    # The one before the last is still retried.
    assert decide(error, MAX_DELIVER - 1, MAX_DELIVER, BACKOFF).verdict is Verdict.NAK


def test_a_single_delivery_consumer_dead_letters_the_first_failure() -> None:
    outcome = decide(TransientError("x"), 1, 1, (2.0,))
    assert outcome.verdict is Verdict.DEAD_LETTER


def test_unlimited_deliveries_never_give_up() -> None:
    outcome = decide(TransientError("x"), 10_000, -1, BACKOFF)
    assert outcome == Outcome(Verdict.NAK, delay_s=15.0, reason="x")


def test_an_empty_schedule_retries_after_one_second() -> None:
    assert decide(RuntimeError("x"), 1, MAX_DELIVER, ()).delay_s == 1.0


def test_describe_error_names_the_type() -> None:
    assert describe_error(ValueError("bad value")) == "ValueError: bad value"
    assert describe_error(TimeoutError()) == "TimeoutError: TimeoutError()"
