"""JSON log lines for every service, joinable with traces.

Each record becomes one JSON object on one line (stderr)::

    {"timestamp": "2025-01-31T12:00:00.123Z", "level": "INFO", "service": "fetcher",
     "logger": "services.fetcher.robots", "message": "...", "tenant": "A...", "job": "...",
     "trace_id": "4bf9...", "span_id": "00f0..."}

``tenant`` and ``job`` come from the delivery being handled (the consume loop sets them
with :func:`delivery_context`), ``trace_id``/``span_id`` from the current OpenTelemetry
span; each is ``null`` outside a delivery. A record with an exception adds ``error``
(``type``, ``message``, ``stack``); fields passed with ``extra=`` are added as well.

Never log secrets or page bodies. As a backstop the formatter redacts what looks like a
credential (NATS nkey seeds, JWTs, PEM blocks, passwords in URLs, ``password=``-style
pairs, bearer tokens) and cuts every string field to :data:`MAX_FIELD_CHARS` characters.

``CRAWLMESH_LOG_LEVEL`` (default ``INFO``) sets the level of crawlmesh's own loggers;
chatty libraries (``httpx``, ``httpcore``) log from ``WARNING`` up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

import orjson
from opentelemetry import trace

LOG_LEVEL_ENV = "CRAWLMESH_LOG_LEVEL"
"""Environment variable with the log level name (``DEBUG``, ``INFO``, ``WARNING``...)."""

MAX_FIELD_CHARS = 4000
"""Longer string fields are cut (a page body must never reach a log line whole)."""

QUIET_LOGGERS: dict[str, int] = {"httpx": logging.WARNING, "httpcore": logging.WARNING}
"""Libraries whose INFO lines (one per HTTP request) would drown the services' own."""

TENANT: ContextVar[str | None] = ContextVar("crawlmesh_log_tenant", default=None)
JOB: ContextVar[str | None] = ContextVar("crawlmesh_log_job", default=None)

_REDACTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"-----BEGIN [A-Z0-9 ]+-----.*?-----END [A-Z0-9 ]+-----", re.S), "[REDACTED block]"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*"), "[REDACTED jwt]"),
    (re.compile(r"\bS[A-Z][A-Z2-7]{56}\b"), "[REDACTED nkey seed]"),
    (re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@"), r"\1[REDACTED]@"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 [REDACTED]"),
    (re.compile(r"(?i)\b(password|passwd|secret|token|api[_-]?key)(['\"]?\s*[:=]\s*['\"]?)"
                r"[^\s'\",;&]+"), r"\1\2[REDACTED]"),
)

_RECORD_FIELDS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime",
                                                                   "taskName"}


def redact(text: str) -> str:
    """``text`` with credentials replaced by ``[REDACTED ...]`` and cut to
    :data:`MAX_FIELD_CHARS` characters."""
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    if len(text) > MAX_FIELD_CHARS:
        text = f"{text[:MAX_FIELD_CHARS]}... [{len(text) - MAX_FIELD_CHARS} chars cut]"
    return text


@contextlib.contextmanager
def delivery_context(tenant: str | None, job: str | None) -> Iterator[None]:
    """Within this block (and tasks started in it), log lines carry ``tenant`` and ``job``."""
    tenant_token, job_token = TENANT.set(tenant), JOB.set(job)
    try:
        yield
    finally:
        JOB.reset(job_token)
        TENANT.reset(tenant_token)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line (see module docstring) for service ``service``."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ctx = trace.get_current_span().get_span_context()
        valid = ctx.is_valid
        doc: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": redact(record.getMessage()),
            "tenant": getattr(record, "tenant", None) or TENANT.get(),
            "job": getattr(record, "job", None) or JOB.get(),
            "trace_id": trace.format_trace_id(ctx.trace_id) if valid else None,
            "span_id": trace.format_span_id(ctx.span_id) if valid else None,
        }
        if record.exc_info and record.exc_info[0] is not None:
            kind, value, _ = record.exc_info
            doc["error"] = {"type": kind.__name__, "message": redact(str(value)),
                            "stack": redact(self.formatException(record.exc_info))}
        if record.stack_info:
            doc["stack"] = redact(self.formatStack(record.stack_info))
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and key not in doc:
                doc[key] = _safe(value)
        return orjson.dumps(doc, default=lambda v: redact(repr(v))).decode()


def _safe(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(repr(value))


def setup_logging(service: str, level: str | int | None = None) -> None:
    """Send every log record of this process to stderr as JSON lines for ``service``.

    ``level`` defaults to ``$CRAWLMESH_LOG_LEVEL`` or ``INFO``. Replaces the root logger's
    handlers, routes ``warnings`` and uncaught exceptions through logging too.
    """
    level = level or os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(max(quiet, root.level))
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught


def _log_uncaught(kind: type[BaseException], value: BaseException,
                  tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("crawlmesh").critical("uncaught exception", exc_info=(kind, value, tb))


__all__ = ["JOB", "TENANT", "JsonFormatter", "delivery_context", "redact", "setup_logging"]
