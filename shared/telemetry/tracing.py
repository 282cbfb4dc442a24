"""OpenTelemetry tracing for every service: the provider, its exporters, and the spans of
the consume loop.

How a crawl is traced (DESIGN.md "Running it"):

- Each delivery is handled inside a ``CONSUMER`` span ``process <kind>`` (``kind`` is the
  subject kind: ``links``, ``frontier``, ``fetched``, ``parsed``...), continuing the
  context its producer put in the W3C ``traceparent``/``tracestate`` message headers.
- Each output is published inside a ``PRODUCER`` span ``publish <kind>``, child of that
  consumer span, whose context is injected into the output's headers.
- An output marked ``new_trace`` (dedup's frontier entry for a page it just admitted)
  instead opens the ``PRODUCER`` root span ``page`` of a *new* trace, with a span link to
  the current (discovering) span. The fetch, parse and result of that page continue the
  new trace, so there is one trace per page from admission to result, and links lead back,
  page by page, to the trace of the submission that the seeder handled.

Configuration, by the standard OpenTelemetry environment variables:

``OTEL_SERVICE_NAME``
    Defaults to ``crawlmesh-<service>`` (``OTEL_RESOURCE_ATTRIBUTES`` is honoured too).
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    When either is set, spans are exported with OTLP over HTTP (protobuf); the exporter
    also reads ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``, ``..._TIMEOUT``,
    ``..._COMPRESSION`` and ``..._CERTIFICATE``. gRPC is not supported (a warning is logged
    and HTTP used).
``OTEL_TRACES_EXPORTER``
    ``none`` exports nothing even with an endpoint; ``otlp`` exports even without one (to
    the exporter's default ``http://localhost:4318/v1/traces``). Unset: OTLP only when an
    endpoint is set. With no exporter, spans are still created, so logs carry trace ids.
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_PROPAGATORS``, ``OTEL_SDK_DISABLED``
    Read by the SDK as usual (default: parent-based always-on, W3C trace context + baggage).

And one of crawlmesh's own, for tests and debugging:

``CRAWLMESH_TRACE_FILE``
    Append every finished span as one JSON line (see :func:`span_record`) to this file.
    ``{service}`` and ``{pid}`` in the path are replaced, so several processes can write
    files of their own; without them they share one file safely (each batch is one
    ``write`` on an ``O_APPEND`` descriptor, so lines never interleave on a local file
    system). Works alongside OTLP.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from shared import subjects
from shared.contracts import FrontierEntry
from shared.contracts.base import Contract

log = logging.getLogger(__name__)

TRACE_FILE_ENV = "CRAWLMESH_TRACE_FILE"
"""Environment variable naming the JSON-lines span file (see module docstring)."""

MESSAGING_SYSTEM = "nats"

tracer = trace.get_tracer("crawlmesh")
"""The tracer of every crawlmesh span (a proxy until :func:`setup_tracing` runs)."""

_provider: TracerProvider | None = None


# ---- set-up -------------------------------------------------------------------------------


def setup_tracing(service: str, environ: Mapping[str, str] | None = None) -> TracerProvider:
    """Install the global tracer provider of service process ``service`` (idempotent).

    Exporters follow the environment (module docstring); the resource names the service
    (``service.name``, ``crawlmesh.service``) and the process (``process.pid``,
    ``service.instance.id`` = ``<host>:<pid>``). Returns the provider. Buffered spans are
    exported at exit (an ``atexit`` hook) or by :func:`flush_tracing`.
    """
    global _provider
    if _provider is not None:
        return _provider
    env = os.environ if environ is None else environ
    pid = os.getpid()
    resource = Resource.create({"crawlmesh.service": service, "process.pid": pid,
                                "service.instance.id": f"{socket.gethostname()}:{pid}"})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"crawlmesh-{service}"}))
    provider = TracerProvider(resource=resource)
    for exporter in _exporters(service, env):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def flush_tracing(timeout_s: float = 5.0) -> None:
    """Export the spans buffered so far, waiting up to ``timeout_s`` seconds (blocking; a
    no-op before :func:`setup_tracing`)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def _exporters(service: str, env: Mapping[str, str]) -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    chosen = {name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",")}
    chosen.discard("")
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT")
    if "none" not in chosen and ("otlp" in chosen or (not chosen and endpoint)):
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
        if protocol != "http/protobuf":
            log.warning("OTLP protocol %r is not supported: exporting with http/protobuf",
                        protocol)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if unknown := chosen - {"otlp", "none"}:
        log.warning("OTEL_TRACES_EXPORTER %s not supported (only otlp, none): ignored",
                    ",".join(sorted(unknown)))
    if template := env.get(TRACE_FILE_ENV):
        path = template.replace("{service}", service).replace("{pid}", str(os.getpid()))
        exporters.append(SpanFileExporter(Path(path)))
    return exporters


# ---- the file exporter --------------------------------------------------------------------


def _hex_span(span_id: int) -> str:
    return trace.format_span_id(span_id)


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a JSON-ready dict.

    Shape: ``trace_id`` (32 hex), ``span_id`` (16 hex), ``parent`` (16 hex span id in the same
    trace, or None for a root), ``links`` (``[{"trace_id", "span_id"}]``), ``name``,
    ``kind`` (``CONSUMER``, ``PRODUCER``...), ``service`` (``service.name``), ``pid``,
    ``start_ns``/``end_ns`` (Unix epoch nanoseconds), ``status`` (``UNSET``/``OK``/``ERROR``)
    and ``attributes``.
    """
    ctx = span.get_span_context()
    assert ctx is not None
    resource = span.resource.attributes
    return {
        "trace_id": trace.format_trace_id(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent": _hex_span(span.parent.span_id) if span.parent else None,
        "links": [{"trace_id": trace.format_trace_id(link.context.trace_id),
                   "span_id": _hex_span(link.context.span_id)} for link in span.links],
        "name": span.name,
        "kind": span.kind.name,
        "service": resource.get(SERVICE_NAME),
        "pid": resource.get("process.pid"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


class SpanFileExporter(SpanExporter):
    """Appends finished spans to ``path`` as JSON lines (:func:`span_record`)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._fd is None:
            return SpanExportResult.FAILURE
        data = b"".join(orjson.dumps(span_record(s), default=str) + b"\n" for s in spans)
        try:
            os.write(self._fd, data)  # one write per batch: appended whole (O_APPEND)
        except OSError as error:
            log.warning("cannot write spans to %s: %r", self.path, error)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# ---- spans of the consume loop ------------------------------------------------------------


def destination_kind(subject: str) -> str:
    """The low-cardinality kind of ``subject`` for span names: ``links``, ``frontier``,
    ``results``..., ``reply`` for an ``_INBOX`` reply, ``advisory`` for a JetStream
    advisory, else its first token."""
    try:
        return subjects.parse(subject).kind
    except subjects.SubjectError:
        if subject.startswith("_INBOX."):
            return "reply"
        if subject.startswith("$JS.EVENT.ADVISORY."):
            return "advisory"
        return subject.split(".", 1)[0]


def current_span() -> Span:
    return trace.get_current_span()


@contextlib.contextmanager
def consuming(
    subject: str, headers: Mapping[str, str], *, consumer: str, tenant: str, job: str,
    delivered: int, stream_seq: int,
) -> Iterator[Span]:
    """The current ``CONSUMER`` span of one delivery, continuing the trace in ``headers``.

    Exceptions are not recorded here: the loop reports the outcome with :func:`settled`.
    """
    parent = propagate.extract(headers)
    attributes: dict[str, str | int] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "process",
        "messaging.destination.name": subject,
        "messaging.consumer.group.name": consumer,
        "crawlmesh.tenant": tenant,
        "crawlmesh.job": job,
        "crawlmesh.delivery_count": delivered,
        "crawlmesh.stream_seq": stream_seq,
    }
    if msg_id := headers.get("Nats-Msg-Id"):
        attributes["messaging.message.id"] = msg_id
    with tracer.start_as_current_span(
        f"process {destination_kind(subject)}", context=parent, kind=SpanKind.CONSUMER,
        attributes=attributes, record_exception=False, set_status_on_exception=False,
    ) as span:
        yield span


def settled(span: Span, verdict: str, reason: str = "", error: BaseException | None = None) -> None:
    """Record a delivery's outcome (``ack``, ``nak``, ``dead_letter``) on its span; a nak
    or dead letter marks the span as an error, with the exception if there was one."""
    span.set_attribute("crawlmesh.outcome", verdict)
    if error is not None:
        span.record_exception(error)
    if verdict != "ack":
        span.set_status(Status(StatusCode.ERROR, reason[:500] or verdict))


@contextlib.contextmanager
def publishing(subject: str, msg_id: str, message: Contract,
               new_trace: bool = False) -> Iterator[dict[str, str]]:
    """A ``PRODUCER`` span for one publish; yields the trace headers to send with it.

    With ``new_trace`` the span is the root ``page`` of a new trace, linked to the current
    span (see module docstring). A publish that raises marks the span as an error.
    """
    attributes: dict[str, str | int] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation.type": "send",
        "messaging.destination.name": subject,
    }
    if msg_id:
        attributes["messaging.message.id"] = msg_id
    name = f"publish {destination_kind(subject)}"
    links: list[Link] = []
    parent: otel_context.Context | None = None
    if new_trace:
        name = "page"
        found = current_span().get_span_context()
        links = [Link(found, {"crawlmesh.link": "discovered_by"})] if found.is_valid else []
        parent = otel_context.Context()  # empty: no parent, a new trace id
        attributes.update(page_attributes(message))
    with tracer.start_as_current_span(name, context=parent, kind=SpanKind.PRODUCER,
                                      attributes=attributes, links=links):
        headers: dict[str, str] = {}
        propagate.inject(headers)
        yield headers


def page_attributes(message: Contract) -> dict[str, str | int]:
    """Attributes of a page's root span: tenant, job, fingerprint, URL, host and depth."""
    if not isinstance(message, FrontierEntry):
        return {}
    return {
        "crawlmesh.tenant": message.tenant,
        "crawlmesh.job": message.job_id,
        "crawlmesh.page.fingerprint": message.fingerprint,
        "crawlmesh.page.depth": message.depth,
        "url.full": message.url,
        "server.address": message.host,
    }
