"""Reading seed submissions: a bare URL or a JSON crawl request, and clear rejections."""

from __future__ import annotations

import orjson
import pytest
from pydantic import ValidationError

from services.seeder.intake import MAX_SUBMISSION_BYTES, SubmissionError, parse_submission
from shared.contracts import CrawlRequest, ScopeMode


def test_a_bare_url_is_a_crawl_of_that_url_with_default_limits() -> None:
    request = parse_submission(b"  https://example.org/start\n")
    assert request == CrawlRequest(seeds=("https://example.org/start",))
    assert (request.max_depth, request.max_pages, request.reply_to) == (3, 10_000, None)


def test_a_json_request_keeps_every_field() -> None:
    payload = {
        "seeds": ["https://example.org/", "http://example.net/a"],
        "job_id": "my-job_1", "label": "nightly", "max_depth": 1, "max_pages": 50,
        "max_pages_per_host": 10, "scope": {"mode": "same-domain", "deny": ["/private/"]},
        "rules": [{"name": "h1", "css": "h1::text"}], "reply_to": "_INBOX.abc.def",
    }
    request = parse_submission(orjson.dumps(payload))
    assert request.seeds == ("https://example.org/", "http://example.net/a")
    assert request.job_id == "my-job_1" and request.label == "nightly"
    assert (request.max_depth, request.max_pages, request.max_pages_per_host) == (1, 50, 10)
    assert request.scope.mode is ScopeMode.SAME_DOMAIN and request.scope.deny == ("/private/",)
    assert request.rules[0].name == "h1"
    assert request.reply_to == "_INBOX.abc.def"


@pytest.mark.parametrize(("payload", "message"), [
    (b"", "empty submission"),
    (b" \n\t ", "empty submission"),
    (b"{not json", "invalid JSON"),
    (b'{"seeds": ["https://example.org/"], "colour": "blue"}', "colour: Extra inputs are not permitted"),
    (b'{"seeds": []}', "seeds"),
    (b'{"seeds": ["https://example.org/"], "max_pages": 0}', "max_pages"),
    (b'{"seeds": ["ftp://example.org/file"]}', "unsupported scheme 'ftp'"),
    (b"ftp://example.org/file", "unsupported scheme 'ftp'"),
    (b"mailto:someone@example.org", "unsupported scheme 'mailto'"),
    (b"example.org/no-scheme", "not an absolute URL"),
    (b"https:///no-host", "no host"),
    (b"https://example.org:99999/", "not a URL"),
    (b"https://example.org/" + b"a" * 3000, "longer than 2048"),
    (b"\xff\xfehttps://example.org/", "not UTF-8"),
    (b"x" * (MAX_SUBMISSION_BYTES + 1), f"the limit is {MAX_SUBMISSION_BYTES}"),
    (b'{"seeds": ["https://example.org/"], "reply_to": "crawl.seeds.x"}', "reply_to"),
])
def test_invalid_submissions_are_refused_with_a_clear_message(payload: bytes, message: str) -> None:
    with pytest.raises(SubmissionError) as caught:
        parse_submission(payload)
    assert message in str(caught.value)


def test_the_size_limit_is_checked_before_anything_else() -> None:
    payload = b"https://example.org/" + b" " * MAX_SUBMISSION_BYTES
    with pytest.raises(SubmissionError, match="bytes; the limit is"):
        parse_submission(payload)
    assert parse_submission(payload[:MAX_SUBMISSION_BYTES]).seeds == ("https://example.org/",)


def test_invalid_json_field_errors_name_the_request() -> None:
    with pytest.raises(SubmissionError, match=r"^invalid crawl request: max_depth"):
        parse_submission(b'{"seeds": ["https://example.org/"], "max_depth": -1}')


@pytest.mark.parametrize("reply_to", ["crawl.seeds.ATENANT", "_INBOX.", "_INBOX.a b", "_INBOX.>"])
def test_reply_to_must_be_an_inbox_subject(reply_to: str) -> None:
    with pytest.raises(ValidationError, match="reply_to"):
        CrawlRequest(seeds=("https://example.org/",), reply_to=reply_to)
    assert CrawlRequest(seeds=("https://example.org/",), reply_to="_INBOX.x1.y2").reply_to
