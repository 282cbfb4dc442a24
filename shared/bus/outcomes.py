"""Handler outcomes, decided in one place: ack, nak with delay, or dead letter + term.

A handler signals by returning (success) or raising:

* :class:`TransientError` (or any unexpected exception): retry after a delay from the
  backoff schedule (or the error's own ``retry_after_s``), until the last delivery, which
  is dead-lettered.
* :class:`UnprocessableError` (including payload :class:`~shared.codec.DecodeError`):
  dead letter + term at once; retrying cannot help.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shared.codec import DecodeError


class TransientError(Exception):
    """A failure that may pass: retry later (after ``retry_after_s`` if given)."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class UnprocessableError(Exception):
    """A message that can never be processed: dead-letter it with this reason."""


class Verdict(StrEnum):
    ACK = "ack"
    NAK = "nak"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the loop does with a delivery: the verdict, a nak delay, a dead-letter reason."""

    verdict: Verdict
    delay_s: float = 0.0
    reason: str = ""


def describe_error(error: BaseException) -> str:
    """``Type: message`` of an exception, for dead letters and logs."""
    text = str(error) or repr(error)
    return f"{type(error).__name__}: {text}"


def decide(
    error: BaseException | None, delivered: int, max_deliver: int, backoff_s: tuple[float, ...]
) -> Outcome:
    """Turn a handler's result into an :class:`Outcome`.

    Args:
        error: what the handler raised, or None on success.
        delivered: this delivery's number (1-based, ``num_delivered``).
        max_deliver: the consumer's ``max_deliver`` (-1 = unlimited).
        backoff_s: redelivery delays by attempt, seconds.
    """
    if error is None:
        return Outcome(Verdict.ACK)
    if isinstance(error, (UnprocessableError, DecodeError)):
        return Outcome(Verdict.DEAD_LETTER, reason=str(error))
    reason = str(error) if isinstance(error, TransientError) else describe_error(error)
    if 0 < max_deliver <= delivered:
        return Outcome(
            Verdict.DEAD_LETTER, reason=f"gave up after {delivered} deliveries: {reason}"
        )
    delay = backoff_s[min(delivered, len(backoff_s)) - 1] if backoff_s else 1.0
    if isinstance(error, TransientError) and error.retry_after_s is not None:
        delay = error.retry_after_s
    return Outcome(Verdict.NAK, delay_s=delay, reason=reason)
