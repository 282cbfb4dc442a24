"""Reading a seed submission: a bare URL (text) or a JSON crawl request.

Raises :class:`SubmissionError` with a reason a tenant can act on; never crashes on input.
"""

from __future__ import annotations

import orjson
from pydantic import ValidationError

from shared.codec import describe
from shared.contracts import CrawlRequest, check_http_url

MAX_SUBMISSION_BYTES = 256 * 1024
"""Largest submission accepted (bytes)."""


class SubmissionError(ValueError):
    """A submission that cannot become a job; the message says why."""


def parse_submission(payload: bytes) -> CrawlRequest:
    """Turn intake bytes into a :class:`CrawlRequest`.

    A payload starting with ``{`` is a JSON crawl request; anything else is one bare URL
    (surrounding whitespace ignored).

    Raises:
        SubmissionError: empty, oversized, not UTF-8, invalid JSON, unknown fields, or an
            invalid URL — the message names the problem.
    """
    if len(payload) > MAX_SUBMISSION_BYTES:
        raise SubmissionError(
            f"submission is {len(payload)} bytes; the limit is {MAX_SUBMISSION_BYTES}"
        )
    try:
        text = payload.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise SubmissionError("submission is not UTF-8 text") from None
    if not text:
        raise SubmissionError("empty submission: send a URL or a JSON crawl request")
    if text.startswith("{"):
        try:
            data = orjson.loads(text)
        except orjson.JSONDecodeError as error:
            raise SubmissionError(f"invalid JSON: {error}") from None
        try:
            return CrawlRequest.model_validate(data)
        except ValidationError as error:
            raise SubmissionError(describe(error, "crawl request")) from None
    try:
        return CrawlRequest(seeds=(check_http_url(text),))
    except ValueError as error:
        raise SubmissionError(str(error)) from None
