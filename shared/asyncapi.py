"""The AsyncAPI 3.0 document of crawlmesh's subjects, streams and messages.

Generated into ``proto/asyncapi.json`` by :func:`shared.schemas.write_proto`; channels are
built by calling the :mod:`shared.subjects` builders and streams are read from
:mod:`shared.streams`, so a change of token position or stream shows up as drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from nats.js.api import RetentionPolicy

from shared import streams, subjects
from shared.bus import replays
from shared.contracts import MESSAGES, CrawlRequest, DeadLetter, JobRecord, SeedReply
from shared.contracts.requests import MAX_URL_CHARS
from shared.schemas import (
    _EXAMPLE_FINGERPRINT,
    _EXAMPLE_JOB,
    _JOB,
    _TENANT,
    ENVELOPE_CONTENT_TYPE,
    FIX_COMMAND,
    JSON_CONTENT_TYPE,
    SCHEMA_FORMAT,
    SCHEMAS_DIR,
    _binary_note,
    _layout,
    _PartitionSlot,
    _slots,
    _summary,
)
from shared.settings import MeshSettings
from shared.subjects import PARTITIONS, Stage


@dataclass(frozen=True)
class _Channel:
    """A channel: subject (with sentinels), messages, senders and tenant-side readers."""

    key: str
    subject: str | None
    messages: tuple[str, ...]
    title: str
    description: str
    senders: tuple[tuple[str, str], ...] = ()
    readers: tuple[tuple[str, str], ...] = ()  # mesh channels: the stream's consumers
    server: str = "mesh"
    mesh_subject: str | None = None  # tenant-side channels: the MESH subject behind them


def _channels() -> tuple[_Channel, ...]:
    t, j, seed = _TENANT, _JOB, ("CrawlRequest", "SeedURL")
    dlq = subjects.dlq(Stage.SEEDER, t, j).replace(f".{Stage.SEEDER}.", ".{stage}.", 1)
    give_up = "Dead-letters what it cannot process (invalid payload, error, last delivery)."
    return (
        _Channel("intake", subjects.seeds(t), seed, "Seed intake", "A tenant's seeds: "
                 "CrawlRequest JSON or a bare URL, via its `crawl.seeds` service import."),
        _Channel("links", subjects.links(t, j), ("DiscoveredLinks",), "Discovered links",
                 "Links for dedup: a job's seeds, a page's outlinks, a redirect.",
                 (("seeder", "Publishes an accepted request's seeds at depth 0."),
                  ("parser", "Publishes a parsed page's outlinks."))),
        _Channel("frontier", subjects.frontier(_PartitionSlot(0), t, j), ("FrontierEntry",),
                 "Frontier", "Admitted URLs, partitioned by a stable hash of the host.",
                 (("dedup", "Publishes each URL it admits."),)),
        _Channel("expanded", subjects.expanded(t, j), ("PageExpanded",), "Page expanded",
                 "Dedup's report that a page's outlinks were admitted or rejected.",
                 (("dedup", "Reports once per page how many outlinks it admitted."),)),
        _Channel("fetched", subjects.fetched(t, j), ("FetchedPage",), "Fetched pages",
                 "Fetch outcomes; the body follows the JSON as raw bytes (CMB1 envelope).",
                 (("fetcher", "Publishes every fetch outcome, errors included."),)),
        _Channel("parsed", subjects.parsed(t, j), ("ParsedPage",), "Parsed pages",
                 "Parsed pages for the sink.", (("parser", "Publishes each page's parse."),)),
        _Channel("deadLetters", dlq, ("DeadLetter",), "Dead letters", "Messages the mesh "
                 "could not process, by the stage that gave up; original payload kept.",
                 tuple((str(stage), give_up) for stage in Stage)),
        _Channel("ledger", subjects.ledger(t, j, "admitted").rsplit(".", 1)[0] + ".{kind}",
                 ("LedgerEntry",), "Completion ledger", "One entry per page and kind "
                 "(admitted, finished, failed; seeded once per job); the server's per-subject "
                 "counts are the job's counters.",
                 (("dedup", "Records each URL it admits (before the expansion report)."),
                  ("sink", "Records each finished or failed page, and the seeds' expansion."))),
        _Channel("parked", subjects.parked(t, j), ("PageResult",), "Parked results",
                 "Results refused while the tenant's RESULTS stream is full; drained later.",
                 (("sink", "Parks a result the tenant's stream refused."),)),
        _Channel("tenantResults", subjects.results(t, j), ("PageResult",), "Results (MESH "
                 "side)", "One result per page, into the tenant's RESULTS stream.",
                 (("sink", "Delivers one result per page, once."),)),
        _Channel("tenantEvents", subjects.events(t, j), ("JobEvent",), "Job events (MESH "
                 "side)", "Job lifecycle events, into the tenant's EVENTS stream.",
                 (("seeder", "Announces a job started, or a submission rejected."),
                  ("sink", "Announces job progress and completion."))),
        _Channel("seedReplies", None, ("SeedReply",), "Seed replies", "Not sent: a tenant's "
                 "inbox is in another account, so the seeder answers with a started/rejected "
                 "JobEvent on crawl.events.<job> instead (reply_to is accepted and ignored)."),
        _Channel("crawlSeeds", "crawl.seeds", seed, "Seeds (tenant side)", "Where a tenant "
                 "publishes seeds; MESH imports it as the tenant's slot of crawl.seeds.*.",
                 (("tenant", "Submits a crawl request or a bare URL."),), (), "tenant",
                 subjects.seeds(t)),
        _Channel("crawlResults", "crawl.results.{job}", ("PageResult",), "Results (tenant "
                 "side)", "A tenant's results, in its own account.", (),
                 (("tenant", "Reads one result per page of its jobs."),), "tenant",
                 subjects.results(t, j)),
        _Channel("crawlEvents", "crawl.events.{job}", ("JobEvent",), "Job events (tenant "
                 "side)", "A tenant's job events, in its own account.", (),
                 (("tenant", "Reads started / progress / completed events."),), "tenant",
                 subjects.events(t, j)),
        _Channel("maxDeliveriesAdvisories", streams.ADVISORY_MAX_DELIVERIES
                 + ".{stream}.{consumer}", ("MaxDeliveriesAdvisory",), "MAX_DELIVERIES "
                 "advisories", "nats-server's notice that a message exhausted max_deliver "
                 "unacked (crash, ack timeout); the message is dead-lettered from here."),
    )


def _subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` is one token, ``>`` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or token not in ("*", have[index]):
            return False
    return len(want) == len(have)


def _stream_specs() -> tuple[tuple[streams.StreamSpec, ...], tuple[streams.ConsumerSpec, ...]]:
    specs = (*streams.MESH_STREAMS, streams.intake_stream(_TENANT),
             streams.TENANT_RESULTS, streams.TENANT_EVENTS)
    # The 64 partition consumers of FRONTIER are documented as one, fetcher-p{partition}.
    shared = tuple(c for c in streams.MESH_CONSUMERS if c not in streams.FETCHER_PARTITIONS)
    partition = streams.ConsumerSpec(streams.FRONTIER.name, "fetcher-p{partition}",
                                     Stage.FETCHER, filter_subject="mesh.frontier.{partition}.>")
    return specs, (partition, *shared, *streams.tenant_stage_consumers(_TENANT),
                   streams.seeder_consumer(_TENANT),
                   streams.parked_consumer(_TENANT))


def _service_of(consumer: streams.ConsumerSpec) -> str:
    return "every service" if consumer is streams.DLQ_ADVISOR else str(consumer.stage)


def _stream_doc(spec: streams.StreamSpec, consumers: list[streams.ConsumerSpec]) -> dict[str, Any]:
    retention = RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS
    return {
        "name": _slots(spec.name),
        "subjects": [_slots(s) for s in spec.subjects],
        "retention": retention.value,
        "description": _slots(spec.description),
        "perSubjectCap": spec.per_subject_cap,
        "consumers": [{"durable": _slots(c.durable), "stage": str(c.stage), "service": _service_of(c)}
                      for c in consumers],
    }


def _ref(*parts: str) -> dict[str, str]:
    return {"$ref": "#/" + "/".join(parts)}


def _camel(*words: str) -> str:
    joined = "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", " ".join(words)))
    return joined[:1].lower() + joined[1:]


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the mesh: servers, channels, messages, operations.

    Channels cover every subject pattern of :mod:`shared.subjects` (parameters ``tenant``,
    ``job``, ``partition``, ``stage``), the tenant-side subjects, the seeder's reply and the
    MAX_DELIVERIES advisories. ``x-crawlmesh-stream`` on a channel names the stream of
    :mod:`shared.streams` that captures it (name, subjects, retention, consumers). Message
    payloads reference ``./schemas/<Model>.json`` relative to ``proto/asyncapi.json``.

    Returns:
        The document as a JSON-ready dict.

    Raises:
        shared.subjects.SubjectError: a subject builder rejects the sentinel tokens.
    """
    specs, all_consumers = _stream_specs()
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for ch in _channels():
        channel: dict[str, Any] = {
            "address": _slots(ch.subject) if ch.subject else None,
            "title": ch.title,
            "description": ch.description,
            "messages": {name: _ref("components", "messages", name) for name in ch.messages},
        }
        if ch.subject:
            channel["servers"] = [_ref("servers", ch.server)]
            names = re.findall(r"\{(\w+)\}", channel["address"])
            channel["parameters"] = {n: _ref("components", "parameters", n) for n in names}
        captured = ch.mesh_subject or ch.subject or ""
        if captured.startswith("tenant."):  # MESH's import of the tenant's export
            _, _, kind, job = captured.split(".")
            captured = f"crawl.{kind}.{job}"
        spec = next((s for s in specs for p in s.subjects if _subject_matches(p, captured)), None)
        consumers = [c for c in all_consumers if spec and c.stream == spec.name]
        if spec is not None:
            channel["x-crawlmesh-stream"] = _stream_doc(spec, consumers)
        if ch.mesh_subject:
            channel["x-crawlmesh-mesh-subject"] = _slots(ch.mesh_subject)
        channels[ch.key] = channel
        messages = [_ref("channels", ch.key, "messages", name) for name in ch.messages]
        readers = list(ch.readers) if ch.server == "tenant" else [
            (_service_of(c), f"Pulls from {_slots(c.stream)} as durable consumer {c.durable} "
             "(explicit ack).") for c in consumers]
        for action, parties in (("send", ch.senders), ("receive", readers)):
            for service, summary in parties:
                operation: dict[str, Any] = {
                    "action": action, "channel": _ref("channels", ch.key), "summary": summary,
                    "messages": messages, "x-crawlmesh-service": service,
                }
                if "CrawlRequest" in ch.messages:
                    operation["reply"] = {
                        "address": {"location": "$message.payload#/reply_to",
                                    "description": "CrawlRequest.reply_to, when set."},
                        "channel": _ref("channels", "seedReplies"),
                        "messages": [_ref("channels", "seedReplies", "messages", "SeedReply")],
                    }
                operations[_camel(service, action, ch.key)] = operation
    return {
        "asyncapi": "3.0.0",
        "id": "urn:crawlmesh",
        "info": {
            "title": "crawlmesh",
            "version": str(max(m.SCHEMA_VERSION for m in MESSAGES)),
            "description": "The subjects, streams and messages of crawlmesh, a distributed "
            "web crawler whose services talk only through NATS JetStream. Generated by "
            f"shared.schemas (`{FIX_COMMAND}`); do not edit.",
        },
        "defaultContentType": JSON_CONTENT_TYPE,
        "servers": _servers(),
        "channels": channels,
        "operations": operations,
        "components": _components(),
        "x-crawlmesh-kv": {
            streams.JOBS_BUCKET: {"key": "{tenant}.{job}",
                                  "value": _ref("components", "messages", JobRecord.__name__)},
        },
    }


def _servers() -> dict[str, Any]:
    host = urlsplit(MeshSettings.model_fields["nats_url"].default).netloc
    return {
        "mesh": {"host": host, "protocol": "nats", "title": "MESH account",
                 "description": "The services' account (operator mode; on a laptop, the "
                 "embedded nats-server of `crawlmesh up`). Set CRAWLMESH_NATS_URL."},
        "tenant": {"host": host, "protocol": "nats", "title": "A tenant's account",
                   "description": "A tenant's own account (user JWT + nkey creds): it "
                   "publishes crawl.seeds and reads its RESULTS and EVENTS streams."},
    }


def _headers(msg_id: str, required: bool, example: str,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    trace = {"type": "string", "description": "W3C Trace Context (optional); the mesh "
             "continues the trace of each input in the outputs it causes (a page admitted "
             "by dedup starts a new trace, linked to it)."}
    return {
        "type": "object",
        "required": ["Nats-Msg-Id"] if required else [],
        "properties": {
            "Nats-Msg-Id": {"type": "string", "description": msg_id, "examples": [example]},
            "traceparent": trace, "tracestate": trace, **(extra or {}),
        },
    }


_REPLAY_HEADERS: dict[str, Any] = {
    replays.REPLAY_HEADER: {
        "type": "string", "pattern": "^[0-9]+$", "examples": ["17"],
        "description": "Set on a dead letter replayed by `crawlmesh dlq replay` (and, for a "
                       "page, on every message it causes): the replay's generation N, the "
                       "dead letter's DLQ sequence; msg ids then end in `:replay<N>`."},
    replays.REPLAY_OF_HEADER: {
        "type": "string", "examples": [f"{streams.FETCHED.name}:42"],
        "description": "With Crawlmesh-Replay: the replayed dead letter's id, "
                       "<stream>:<stream_seq>."},
}


def _components() -> dict[str, Any]:
    messages: dict[str, Any] = {}
    for model in MESSAGES:
        name = model.__name__
        message: dict[str, Any] = {
            "name": name, "title": name, "summary": _summary(model),
            "contentType": JSON_CONTENT_TYPE,
            "payload": {"schemaFormat": SCHEMA_FORMAT,
                        "schema": {"$ref": f"./{SCHEMAS_DIR}/{name}.json"}},
        }
        if model.BINARY_FIELD:
            message["contentType"] = ENVELOPE_CONTENT_TYPE
            message["description"] = f"CMB1 envelope: {_layout(model.BINARY_FIELD)}."
            message["x-crawlmesh-binary"] = _binary_note(model)
        if model is CrawlRequest:
            message["headers"] = _ref("components", "schemas", "TenantHeaders")
        elif model is DeadLetter:
            message["headers"] = _ref("components", "schemas", "DeadLetterHeaders")
        elif model not in (SeedReply, JobRecord):
            message["headers"] = _ref("components", "schemas", "MeshHeaders")
        messages[name] = message
    messages["SeedURL"] = {
        "name": "SeedURL", "title": "SeedURL", "contentType": "text/plain",
        "summary": "A bare seed URL: a crawl with default scope and limits.",
        "payload": {"type": "string", "format": "uri", "maxLength": MAX_URL_CHARS,
                    "description": "One absolute http(s) URL with a host."},
        "headers": _ref("components", "schemas", "TenantHeaders"),
    }
    messages["MaxDeliveriesAdvisory"] = {
        "name": "MaxDeliveriesAdvisory", "title": "MaxDeliveriesAdvisory",
        "summary": "nats-server's io.nats.jetstream.advisory.v1.max_deliver (fields read).",
        "payload": {"type": "object", "required": ["type", "stream", "consumer", "stream_seq",
                                                   "deliveries"],
                    "properties": {"type": {"const": "io.nats.jetstream.advisory.v1.max_deliver"},
                                   "stream": {"type": "string"}, "consumer": {"type": "string"},
                                   "stream_seq": {"type": "integer"},
                                   "deliveries": {"type": "integer"}}},
    }
    example = subjects.msg_id(Stage.FETCHER, "default", _EXAMPLE_JOB, _EXAMPLE_FINGERPRINT, 2)
    return {
        "messages": messages,
        "schemas": {
            "MeshHeaders": _headers(
                "Deterministic id stage:tenant:job:fingerprint[:generation]: the publishing "
                "stage, the URL fingerprint (or a per-job key such as `seeds`), generation "
                "omitted when 0. A redelivered input thus produces no duplicate output inside "
                "the stream's duplicate window.", True, example, _REPLAY_HEADERS),
            "DeadLetterHeaders": _headers(
                "dlq:<stream>:<stream_seq> of the original message, so the in-loop and "
                "advisory paths never double a dead letter.", True, f"dlq:{streams.FETCHED.name}:42"),
            "TenantHeaders": _headers(
                "Optional: JetStream drops a repeat of this id inside the tenant's intake "
                "duplicate window.", False, "my-submission-1"),
        },
        "parameters": _parameters(),
    }


def _parameters() -> dict[str, Any]:
    return {
        "tenant": {"description": "Tenant id: an opaque token shaped like a NATS account "
                   "public key ([A-Za-z0-9_-]{1,64}); a registry maps tenant names to ids.",
                   "examples": ["default"]},
        "job": {"description": "Job id ([A-Za-z0-9_-]{1,64}); generated ids are 12 hex digits "
                "of milliseconds since the epoch + 8 random hex digits.",
                "examples": [_EXAMPLE_JOB]},
        "partition": {"description": f"Frontier partition: first 8 bytes of BLAKE2b of the "
                      f"lower-cased host, mod {PARTITIONS} (shared.subjects.partition_of).",
                      "enum": [str(p) for p in range(PARTITIONS)],
                      "examples": [str(subjects.partition_of("example.com"))]},
        "stage": {"description": "The stage (consuming service) that gave up on the message.",
                  "enum": [str(s) for s in Stage]},
        "kind": {"description": "Ledger entry kind.",
                 "enum": ["admitted", "finished", "failed", "seeded"]},
        "stream": {"description": "Stream of the exhausted message."},
        "consumer": {"description": "Durable consumer that exhausted its deliveries."},
    }


