"""JSON log lines: fields, delivery context, trace ids, exceptions, redaction, size cap."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from datetime import datetime

import nkeys
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from shared.telemetry.logs import MAX_FIELD_CHARS, JsonFormatter, delivery_context, setup_logging

TENANT = "AAHF4MOUOJHBF2XWBE4WNM5WSZTQMMOFWYHIMMUMLQ7FYZSUNW5IR5YX"


def line(message: str, *args: object, exc: bool = False, **extra: object) -> dict:
    """Format one record the way a service would and parse the JSON line back."""
    logger = logging.getLogger("services.fetcher.robots")
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, args,
                               sys.exc_info() if exc else None, extra=extra or None)
    text = JsonFormatter("fetcher").format(record)
    assert "\n" not in text
    return orjson.loads(text)


def test_a_line_has_every_field_and_nulls_outside_a_delivery() -> None:
    doc = line("robots.txt of %s unreachable: %s", "http://a.example", "timeout")
    assert doc["message"] == "robots.txt of http://a.example unreachable: timeout"
    assert (doc["level"], doc["service"], doc["logger"]) == (
        "WARNING", "fetcher", "services.fetcher.robots")
    stamp = datetime.fromisoformat(doc["timestamp"])
    assert doc["timestamp"].endswith("Z") and stamp.utcoffset() is not None
    assert stamp.utcoffset().total_seconds() == 0
    for key in ("tenant", "job", "trace_id", "span_id"):
        assert doc[key] is None


def test_tenant_job_and_trace_ids_come_from_the_delivery_and_the_current_span() -> None:
    tracer = TracerProvider().get_tracer("test")
    with delivery_context(TENANT, "0190abcd00000001"), tracer.start_as_current_span("x") as span:
        doc = line("handled")
    ctx = span.get_span_context()
    assert (doc["tenant"], doc["job"]) == (TENANT, "0190abcd00000001")
    assert doc["trace_id"] == trace.format_trace_id(ctx.trace_id)
    assert doc["span_id"] == trace.format_span_id(ctx.span_id)
    after = line("later")
    assert after["tenant"] is None and after["trace_id"] is None


def test_an_exception_is_one_field_with_type_message_and_stack() -> None:
    try:
        raise ValueError("bad header")
    except ValueError:
        doc = line("cannot parse %s", "http://a.example/x", exc=True)
    assert doc["error"]["type"] == "ValueError"
    assert doc["error"]["message"] == "bad header"
    assert doc["error"]["stack"].startswith("Traceback (most recent call last)")
    assert 'raise ValueError("bad header")' in doc["error"]["stack"]


def test_extra_fields_are_added() -> None:
    doc = line("retry", status=503, host="a.example", tenant=TENANT)
    assert (doc["status"], doc["host"], doc["tenant"]) == (503, "a.example", TENANT)


SEED = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
JWT = "eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.eyJqdGkiOiJYWVoifQ.c2lnbmF0dXJl"


@pytest.mark.parametrize(("secret", "said"), [
    (SEED, "loaded {}"),
    (nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT).decode(), "account {}"),
    (JWT, "user jwt {}"),
    (f"-----BEGIN NATS USER JWT-----\n{JWT}\n------END NATS USER JWT------\n\n"
     f"-----BEGIN USER NKEY SEED-----\n{SEED}\n------END USER NKEY SEED------", "creds {}"),
    ("hunter2", "connecting to nats://crawler:{}@nats:4222"),
    ("hunter2", "connecting to nats://{}@nats:4222"),
    ("hunter2", "config password={}, retries=3"),
    ("abcdef0123456789", "Authorization: Bearer {}"),
], ids=["user-seed", "account-seed", "jwt", "creds-file", "url-password", "url-token",
        "key-value", "bearer"])
def test_secrets_never_reach_a_line(secret: str, said: str) -> None:
    doc = line("%s", said.format(secret), detail=said.format(secret))
    try:
        raise RuntimeError(f"auth failed: {said.format(secret)}")
    except RuntimeError:
        failed = line("connect failed", exc=True)
    for text in (orjson.dumps(doc).decode(), orjson.dumps(failed).decode()):
        assert secret not in text
        assert "[REDACTED" in text


def test_public_keys_and_urls_are_kept() -> None:
    doc = line("tenant %s job %s fetched %s", TENANT, "0190abcd00000001",
               "https://a.example/p?q=1")
    assert doc["message"] == f"tenant {TENANT} job 0190abcd00000001 fetched https://a.example/p?q=1"


def test_a_page_body_is_cut_not_logged_whole() -> None:
    body = "<html>" + "x" * 200_000 + "</html>"
    doc = line("unexpected %s", body, page=body)
    assert len(doc["message"]) < MAX_FIELD_CHARS + 100
    assert len(doc["page"]) < MAX_FIELD_CHARS + 100
    assert doc["message"].endswith("chars cut]")


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level, hook = list(root.handlers), root.level, sys.excepthook
    quiet = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name, old in quiet.items():
        logging.getLogger(name).setLevel(old)
    logging.captureWarnings(False)
    sys.excepthook = hook


def test_setup_logging_writes_json_to_stderr_and_quiets_http_request_lines(
    restored_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("sink", "INFO")
    logging.getLogger("services.sink.handler").info("stored %d results", 3)
    logging.getLogger("httpx").info("HTTP Request: GET http://a.example/ 200 OK")
    logging.getLogger("httpx").warning("HTTP trouble")
    lines = [orjson.loads(text) for text in capsys.readouterr().err.splitlines()]
    assert [(d["service"], d["logger"], d["message"]) for d in lines] == [
        ("sink", "services.sink.handler", "stored 3 results"),
        ("sink", "httpx", "HTTP trouble"),
    ]
