"""proto/ matches the message models, and every contract round-trips through the codec."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from shared import subjects
from shared.asyncapi import asyncapi
from shared.codec import MAGIC, DecodeError, compress, decode, encode
from shared.contracts import (
    MESSAGES,
    BodyRef,
    Contract,
    CrawlRequest,
    DeadLetter,
    DiscoveredLinks,
    ExtractionRule,
    FetchedPage,
    FrontierEntry,
    JobCounters,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    LedgerEntry,
    Link,
    LinkOrigin,
    Outcome,
    PageExpanded,
    PageResult,
    ParsedPage,
    Scope,
    ScopeMode,
    SeedReply,
)
from shared.schemas import (
    ENVELOPE_CONTENT_TYPE,
    FIX_COMMAND,
    check_proto,
    json_schemas,
    render_proto,
    write_proto,
)
from shared.subjects import Stage

try:  # only if already installed; otherwise the small validator below
    import jsonschema
except ImportError:  # pragma: no cover - depends on the environment
    jsonschema = None

REPO_ROOT = Path(__file__).resolve().parents[2]
TENANT = "ABJHLOVMPA4CI6R5KLNGOB4GSLNIY7IOUPAJC4YFNDLQVIOBYQGUWVLA"
JOB = "018f3c2a9b1e4d2c7a9f"
FP = "3b5d5c3712955042212316173ccf37be"
FP2 = "9f86d081884c7d659a2feaa0c55ad015"
AT = datetime(2025, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)
HTML = (b"<!doctype html><html><head><title>Caf\xc3\xa9 menu</title></head><body>"
        b'<a href="/drinks">drinks</a><a rel="nofollow" href="https://ads.example/">ad</a>'
        b"</body></html>")


# ---- realistic instances of every message --------------------------------------------------

def _request() -> CrawlRequest:
    return CrawlRequest(
        seeds=("https://example.com/", "https://example.com/menu?lang=fr"),
        job_id="menu-crawl_2025",
        label="café menus",
        scope=Scope(mode=ScopeMode.SAME_DOMAIN, allow=(r"/menu",), deny=(r"\.pdf$",)),
        max_depth=2, max_pages=500, max_pages_per_host=100,
        rules=(ExtractionRule(name="title", css="title::text"),
               ExtractionRule(name="links", xpath="//a/@href", all=True)),
        reply_to="_INBOX.tenant.answers.1",
    )


def _fetched(**changes: Any) -> FetchedPage:
    page = FetchedPage(
        tenant=TENANT, job_id=JOB, url="https://example.com/menu",
        final_url="https://example.com/menu/", fingerprint=FP, depth=1, status=200,
        content_type="text/html; charset=utf-8", fetched_at=AT, elapsed_ms=87.5,
        body_bytes=len(HTML), body_encoding="zlib", body=compress(HTML),
    )
    return page.model_copy(update=changes)


def examples() -> list[Contract]:
    """At least one realistic instance of every model in MESSAGES (more for variants)."""
    request = _request()
    return [
        request,
        CrawlRequest(seeds=("http://example.org",)),
        SeedReply(tenant=TENANT, accepted=True, job_id=JOB),
        SeedReply(tenant=TENANT, accepted=False, reason="seeds.0: unsupported scheme 'ftp'"),
        JobRecord(tenant=TENANT, job_id=JOB, request=request, state=JobState.COMPLETED,
                  created_at=AT, finished_at=AT + timedelta(minutes=3)),
        DiscoveredLinks(tenant=TENANT, job_id=JOB, origin=LinkOrigin.SEED, depth=0,
                        links=tuple(Link(url=seed) for seed in request.seeds)),
        DiscoveredLinks(tenant=TENANT, job_id=JOB, origin=LinkOrigin.OUTLINKS, depth=2,
                        source_url="https://example.com/menu/", source_fingerprint=FP,
                        links=(Link(url="https://example.com/drinks"),
                               Link(url="https://ads.example/", nofollow=True)),
                        part=1, parts=3),
        FrontierEntry(tenant=TENANT, job_id=JOB, url="https://example.com/drinks",
                      fingerprint=FP2, host="example.com", depth=2, generation=1,
                      not_before=AT + timedelta(seconds=30), admitted_at=AT),
        _fetched(),
        _fetched(body=b"", body_bytes=3_000_000,
                 body_ref=BodyRef(bucket=f"bodies_{TENANT}", name=f"{JOB}/{FP}",
                                  stored_bytes=412_345)),
        _fetched(status=0, content_type=None, body=b"", body_bytes=0, body_encoding="identity",
                 error="robots.txt disallows /menu"),
        ParsedPage(tenant=TENANT, job_id=JOB, url="https://example.com/menu",
                   final_url="https://example.com/menu/", fingerprint=FP, depth=1, status=200,
                   content_type="text/html", fetched_at=AT, title="Café menu",
                   canonical_url="https://example.com/menu/", links_found=2,
                   extracted={"title": "Café menu", "links": ["/drinks"], "price": None}),
        PageExpanded(tenant=TENANT, job_id=JOB, fingerprint=FP, links_seen=2, admitted=1,
                     admitted_fingerprints=(FP2,)),
        PageExpanded(tenant=TENANT, job_id=JOB, fingerprint=None, links_seen=2, admitted=2),
        LedgerEntry(tenant=TENANT, job_id=JOB, kind="admitted", fingerprint=FP),
        PageResult(tenant=TENANT, job_id=JOB, url="https://example.com/menu",
                   final_url="https://example.com/menu/", fingerprint=FP, outcome=Outcome.OK,
                   status=200, content_type="text/html", depth=1, title="Café menu",
                   fetched_at=AT, extracted={"links": ["/drinks"]}),
        PageResult(tenant=TENANT, job_id=JOB, url="https://example.com/broken", fingerprint=FP2,
                   outcome=Outcome.FAILED, depth=2, error="invalid FetchedPage: status"),
        JobEvent(tenant=TENANT, job_id=JOB, kind=JobEventKind.COMPLETED, at=AT,
                 counters=JobCounters(admitted=12, finished=11, failed=1)),
        DeadLetter(id="FETCHED:4711", tenant=TENANT, job_id=JOB, stage=Stage.PARSER,
                   reason="invalid FetchedPage: status: Input should be less than or equal to 999",
                   delivery_count=1, subject=subjects.fetched(TENANT, JOB), stream="FETCHED",
                   stream_seq=4711, dead_at=AT, original=encode(_fetched()) + b"\x00\xff",
                   headers={"Nats-Msg-Id": subjects.msg_id(Stage.FETCHER, TENANT, JOB, FP),
                            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                           "00f067aa0ba902b7-01"}),
    ]


EXAMPLES = examples()


def _id(message: Contract) -> str:
    return type(message).__name__


def json_part(payload: bytes) -> dict[str, Any]:
    """The JSON of a wire payload (the metadata inside a CMB1 envelope)."""
    if payload[:4] == MAGIC:
        size = int.from_bytes(payload[4:8], "big")
        payload = payload[8 : 8 + size]
    return orjson.loads(payload)


# ---- a small JSON Schema validator for the keywords pydantic emits ---------------------------

_ANNOTATIONS = {"$schema", "$id", "$comment", "$defs", "title", "description", "default",
                "examples", "format", "x-crawlmesh-binary"}
_ASSERTIONS = {"$ref", "type", "properties", "required", "additionalProperties", "items",
               "anyOf", "enum", "const", "minimum", "maximum", "minLength", "maxLength",
               "minItems", "maxItems", "pattern"}
_TYPES = {
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "null": lambda v: v is None,
}


def schema_errors(value: Any, schema: dict[str, Any], root: dict[str, Any], at: str = "$"
                  ) -> list[str]:
    """Errors of ``value`` against ``schema`` (fails loudly on keywords it does not know)."""
    unknown = set(schema) - _ANNOTATIONS - _ASSERTIONS
    assert not unknown, f"validator does not implement {sorted(unknown)} (at {at})"
    errors: list[str] = []
    if "$ref" in schema:
        errors += schema_errors(value, root["$defs"][schema["$ref"].split("/")[-1]], root, at)
    if "anyOf" in schema and all(schema_errors(value, s, root, at) for s in schema["anyOf"]):
        errors.append(f"{at}: matches no anyOf branch")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{at}: not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: not one of {schema['enum']}")
    if "type" in schema and not _TYPES[schema["type"]](value):
        return [*errors, f"{at}: not of type {schema['type']}"]
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        errors += [f"{at}.{key}: required" for key in schema.get("required", ())
                   if key not in value]
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], root, f"{at}.{key}")
            elif extra is False:
                errors.append(f"{at}.{key}: not allowed")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, root, f"{at}.{key}")
    if isinstance(value, list):
        for index, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), root, f"{at}[{index}]")
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            errors.append(f"{at}: {len(value)} items")
    if isinstance(value, int | float) and not isinstance(value, bool) and not (
        schema.get("minimum", value) <= value <= schema.get("maximum", value)
    ):
        errors.append(f"{at}: {value} out of range")
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            errors.append(f"{at}: length {len(value)}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{at}: does not match {schema['pattern']}")
    return errors


def validate(instance: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    if jsonschema is not None:  # pragma: no cover - depends on the environment
        validator = jsonschema.Draft202012Validator(schema)
        return [error.message for error in validator.iter_errors(instance)]
    return schema_errors(instance, schema, schema)


# ---- proto/ is up to date ------------------------------------------------------------------

def test_proto_is_up_to_date() -> None:
    drifted = check_proto(REPO_ROOT)
    assert not drifted, (
        f"proto/ is out of date with the message models ({', '.join(drifted)}): run "
        f"`{FIX_COMMAND}` (or `python -m shared.schemas`) and commit proto/"
    )


def test_write_then_check_reports_changed_missing_and_extra_files(tmp_path: Path) -> None:
    written = write_proto(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == set(render_proto())
    assert check_proto(tmp_path) == []

    (tmp_path / "proto/schemas/FetchedPage.json").write_text("{}\n")
    (tmp_path / "proto/asyncapi.json").unlink()
    (tmp_path / "proto/schemas/RetiredMessage.json").write_text("{}\n")
    assert check_proto(tmp_path) == [
        "proto/asyncapi.json", "proto/schemas/FetchedPage.json",
        "proto/schemas/RetiredMessage.json",
    ]

    write_proto(tmp_path)
    assert check_proto(tmp_path) == []
    assert not (tmp_path / "proto/schemas/RetiredMessage.json").exists()


def test_rendering_is_deterministic_sorted_and_newline_terminated() -> None:
    files = render_proto()
    assert files == render_proto()
    for path, text in files.items():
        assert text.endswith("}\n"), path
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True,
                                  ensure_ascii=False) + "\n", path


# ---- JSON Schemas --------------------------------------------------------------------------

@pytest.mark.parametrize("model", MESSAGES, ids=lambda m: m.__name__)
def test_schema_has_identity_and_matches_the_model_fields(model: type[Contract]) -> None:
    schema = json_schemas()[model.__name__]
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"urn:crawlmesh:schema:{model.__name__}:{model.SCHEMA_VERSION}"
    assert schema["title"] == model.__name__
    assert schema["additionalProperties"] is False
    json_fields = set(model.model_fields) - {model.BINARY_FIELD}
    assert set(schema["properties"]) == json_fields
    required = {name for name, info in model.model_fields.items() if info.is_required()}
    assert set(schema.get("required", ())) == required


@pytest.mark.parametrize("model", [m for m in MESSAGES if m.BINARY_FIELD], ids=lambda m: m.__name__)
def test_binary_field_is_documented_as_out_of_band(model: type[Contract]) -> None:
    schema = json_schemas()[model.__name__]
    note = schema["x-crawlmesh-binary"]
    assert note["field"] == model.BINARY_FIELD
    assert note["envelope"] == MAGIC.decode() == "CMB1"
    assert note["contentType"] == ENVELOPE_CONTENT_TYPE
    assert model.BINARY_FIELD not in schema["properties"]
    assert "CMB1 envelope" in schema["description"]


def test_only_binary_models_carry_the_binary_note() -> None:
    schemas = json_schemas()
    assert {n for n, s in schemas.items() if "x-crawlmesh-binary" in s} == {
        m.__name__ for m in MESSAGES if m.BINARY_FIELD
    } == {"FetchedPage", "DeadLetter"}


# ---- round trips ---------------------------------------------------------------------------

def test_examples_cover_every_message() -> None:
    assert {type(message) for message in EXAMPLES} == set(MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=_id)
def test_encode_decode_round_trip(message: Contract) -> None:
    payload = encode(message)
    assert decode(payload, type(message)) == message
    assert payload.startswith(MAGIC) == (message.BINARY_FIELD is not None)


@pytest.mark.parametrize("message", [m for m in EXAMPLES if m.BINARY_FIELD], ids=_id)
def test_binary_field_travels_raw_after_the_json(message: Contract) -> None:
    payload = encode(message)
    raw = getattr(message, message.BINARY_FIELD or "")
    assert payload.endswith(raw)
    assert message.BINARY_FIELD not in json_part(payload)


@pytest.mark.parametrize("message", EXAMPLES, ids=_id)
def test_schema_validates_the_encoded_json(message: Contract) -> None:
    schema = json_schemas()[type(message).__name__]
    assert validate(json_part(encode(message)), schema) == []


def test_schema_validator_rejects_what_the_model_rejects() -> None:
    schema = json_schemas()["FetchedPage"]
    data = json_part(encode(_fetched()))
    assert validate({**data, "status": 1000}, schema)
    assert validate({**data, "body": "PGh0bWw+"}, schema)  # the body never goes in JSON
    assert validate({k: v for k, v in data.items() if k != "fingerprint"}, schema)
    assert validate({**data, "body_ref": {"bucket": "b", "name": "n"}}, schema)


# ---- invalid payloads ----------------------------------------------------------------------

def _payload(message: Contract, **changes: Any) -> bytes:
    """``message`` encoded with its JSON changed (a value of ``...`` removes the key)."""
    data = {**json_part(encode(message)), **changes}
    meta = orjson.dumps({k: v for k, v in data.items() if v is not ...})
    if message.BINARY_FIELD is None:
        return meta
    return MAGIC + len(meta).to_bytes(4, "big") + meta + b"raw"


def _first(model: type[Contract]) -> Contract:
    return next(m for m in EXAMPLES if type(m) is model)


@pytest.mark.parametrize("model", MESSAGES, ids=lambda m: m.__name__)
def test_missing_required_field_is_named(model: type[Contract]) -> None:
    for name, info in model.model_fields.items():
        if info.is_required():
            with pytest.raises(DecodeError, match=rf"invalid {model.__name__}: .*{name}: Field required"):
                decode(_payload(_first(model), **{name: ...}), model)


@pytest.mark.parametrize("model", MESSAGES, ids=lambda m: m.__name__)
def test_unknown_field_and_wrong_version_are_named(model: type[Contract]) -> None:
    with pytest.raises(DecodeError, match="colour: Extra inputs are not permitted"):
        decode(_payload(_first(model), colour="blue"), model)
    with pytest.raises(DecodeError, match="schema_version: Input should be 1"):
        decode(_payload(_first(model), schema_version=2), model)


@pytest.mark.parametrize(
    ("model", "changes", "field"),
    [
        (CrawlRequest, {"seeds": ["ftp://example.com/"]}, r"seeds: .*unsupported scheme 'ftp'"),
        (CrawlRequest, {"seeds": []}, r"seeds: .*at least 1 item"),
        (CrawlRequest, {"job_id": "no spaces"}, r"job_id: String should match pattern"),
        (CrawlRequest, {"rules": [{"name": "t", "css": "a", "xpath": "//a"}]}, r"rules\.0: "),
        (CrawlRequest, {"scope": {"mode": "same-host", "allow": ["("]}}, r"scope\.allow: "),
        (DiscoveredLinks, {"depth": -1}, r"depth: Input should be greater than or equal to 0"),
        (DiscoveredLinks, {"origin": "telepathy"}, r"origin: Input should be"),
        (FrontierEntry, {"admitted_at": "2025-03-01T12:00:00"}, r"admitted_at: .*timezone"),
        (FetchedPage, {"status": 1000}, r"status: Input should be less than or equal to 999"),
        (FetchedPage, {"body_encoding": "br"}, r"body_encoding: Input should be"),
        (PageExpanded, {"admitted": "many"}, r"admitted: Input should be a valid integer"),
        (PageResult, {"outcome": "maybe"}, r"outcome: Input should be"),
        (JobEvent, {"counters": {"admitted": "x"}}, r"counters\.admitted: "),
        (DeadLetter, {"headers": {"Nats-Msg-Id": 7}}, r"headers\.Nats-Msg-Id: "),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_invalid_value_is_named(model: type[Contract], changes: dict[str, Any], field: str
                                ) -> None:
    with pytest.raises(DecodeError, match=rf"invalid {model.__name__}: (.*; )?{field}"):
        decode(_payload(_first(model), **changes), model)


@pytest.mark.parametrize(
    ("model", "payload", "reason"),
    [
        (SeedReply, b"{not json", "invalid JSON for SeedReply"),
        (SeedReply, b"[1, 2]", "expected a JSON object for SeedReply"),
        (FetchedPage, orjson.dumps({"tenant": TENANT}), "FetchedPage payload lacks the CMB1"),
        (FetchedPage, MAGIC + (500).to_bytes(4, "big") + b"{}", "FetchedPage envelope is trunc"),
        (DeadLetter, MAGIC + (2).to_bytes(4, "big") + b"[]", "expected a JSON object for Dead"),
    ],
    ids=["bad-json", "not-object", "no-envelope", "truncated", "envelope-not-object"],
)
def test_malformed_payload_is_rejected(model: type[Contract], payload: bytes, reason: str
                                      ) -> None:
    with pytest.raises(DecodeError, match=re.escape(reason)):
        decode(payload, model)


# ---- AsyncAPI ------------------------------------------------------------------------------

def _pointer(doc: Any, ref: str) -> Any:
    for part in ref.removeprefix("#/").split("/"):
        doc = doc[part]
    return doc


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for value in node.values() for r in _refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _refs(value)]
    return []


def _channel_by_address(doc: dict[str, Any], address: str) -> dict[str, Any]:
    return next(c for c in doc["channels"].values() if c["address"] == address)


def test_asyncapi_covers_every_subject_pattern_of_shared_subjects() -> None:
    doc = asyncapi()
    documented = re.findall(r"^\s{4}(\S+\.\S+)\s", subjects.__doc__ or "", re.MULTILINE)
    assert len(documented) >= 10
    addresses = {c["address"] for c in doc["channels"].values()}
    for pattern in documented:
        assert re.sub(r"<(\w+)>", r"{\1}", pattern) in addresses


def test_asyncapi_refs_resolve() -> None:
    doc = asyncapi()
    files = render_proto()
    for ref in _refs(doc):
        if ref.startswith("#/"):
            _pointer(doc, ref)
        else:
            assert f"proto/{ref.removeprefix('./')}" in files, ref


def test_asyncapi_channels_and_operations_are_consistent() -> None:
    doc = asyncapi()
    assert doc["asyncapi"] == "3.0.0"
    for key, channel in doc["channels"].items():
        slots = set(re.findall(r"\{(\w+)\}", channel["address"] or ""))
        assert set(channel.get("parameters", {})) == slots, key
    for name, operation in doc["operations"].items():
        assert operation["action"] in ("send", "receive"), name
        channel = operation["channel"]["$ref"]
        for message in operation["messages"]:
            assert message["$ref"].startswith(f"{channel}/messages/"), name
    carried = {m for c in doc["channels"].values() for m in c["messages"]}
    assert {m.__name__ for m in MESSAGES} - carried == {"JobRecord"}
    assert doc["x-crawlmesh-kv"]["jobs"]["value"]["$ref"] == "#/components/messages/JobRecord"


@pytest.mark.parametrize(
    ("address", "message", "stream", "retention", "consumers", "senders"),
    [
        ("crawl.seeds.{tenant}", "CrawlRequest", "INTAKE_{tenant}", "workqueue", ["seeder"], set()),
        ("mesh.links.{tenant}.{job}", "DiscoveredLinks", "LINKS", "workqueue", ["dedup-{tenant}"],
         {"seeder", "parser"}),
        ("mesh.frontier.{partition}.{tenant}.{job}", "FrontierEntry", "FRONTIER", "workqueue",
         ["fetcher-p{partition}"], {"dedup"}),
        ("mesh.expanded.{tenant}.{job}", "PageExpanded", "EXPANDED", "workqueue",
         ["sink-expanded-{tenant}"], {"dedup"}),
        ("mesh.fetched.{tenant}.{job}", "FetchedPage", "FETCHED", "workqueue", ["parser-{tenant}"],
         {"fetcher"}),
        ("mesh.parsed.{tenant}.{job}", "ParsedPage", "PARSED", "workqueue", ["sink-{tenant}"], {"parser"}),
        ("mesh.dlq.{stage}.{tenant}.{job}", "DeadLetter", "DLQ", "limits", ["sink-dlq"],
         {str(stage) for stage in Stage}),
        ("mesh.parked.{tenant}.{job}", "PageResult", "PARKED", "workqueue",
         ["sink-parked-{tenant}"], {"sink"}),
        ("tenant.{tenant}.results.{job}", "PageResult", "RESULTS", "limits", [],
         {"sink"}),
        ("tenant.{tenant}.events.{job}", "JobEvent", "EVENTS", "limits", [],
         {"seeder", "sink"}),
        ("crawl.seeds", "SeedURL", "INTAKE_{tenant}", "workqueue", ["seeder"], {"tenant"}),
        ("crawl.results.{job}", "PageResult", "RESULTS", "limits", [], set()),
        ("crawl.events.{job}", "JobEvent", "EVENTS", "limits", [], set()),
    ],
)
def test_asyncapi_encodes_the_message_flow(
    address: str, message: str, stream: str, retention: str, consumers: list[str],
    senders: set[str],
) -> None:
    doc = asyncapi()
    channel = _channel_by_address(doc, address)
    key = next(k for k, c in doc["channels"].items() if c is channel)
    assert message in channel["messages"]
    captured = channel["x-crawlmesh-stream"]
    assert (captured["name"], captured["retention"]) == (stream, retention)
    assert [c["durable"] for c in captured["consumers"]] == consumers
    sending = {op["x-crawlmesh-service"] for op in doc["operations"].values()
               if op["action"] == "send" and op["channel"]["$ref"] == f"#/channels/{key}"}
    assert sending == senders


def test_asyncapi_tenant_side_and_replies() -> None:
    doc = asyncapi()
    operations = doc["operations"]
    assert operations["tenantSendCrawlSeeds"]["reply"]["address"]["location"] == (
        "$message.payload#/reply_to")
    assert operations["seederReceiveIntake"]["reply"]["channel"]["$ref"] == (
        "#/channels/seedReplies")
    assert doc["channels"]["seedReplies"]["address"] is None
    assert {"tenantReceiveCrawlResults", "tenantReceiveCrawlEvents"} <= set(operations)
    for key in ("crawlSeeds", "crawlResults", "crawlEvents"):
        assert doc["channels"][key]["servers"] == [{"$ref": "#/servers/tenant"}]
    assert {s["protocol"] for s in doc["servers"].values()} == {"nats"}


def test_asyncapi_binary_messages_use_the_envelope() -> None:
    messages = asyncapi()["components"]["messages"]
    for model in MESSAGES:
        expected = ENVELOPE_CONTENT_TYPE if model.BINARY_FIELD else "application/json"
        assert messages[model.__name__]["contentType"] == expected
        assert messages[model.__name__]["payload"]["schema"] == {
            "$ref": f"./schemas/{model.__name__}.json"}
    assert messages["SeedURL"]["contentType"] == "text/plain"
    headers = asyncapi()["components"]["schemas"]["MeshHeaders"]["properties"]["Nats-Msg-Id"]
    assert "stage:tenant:job:fingerprint[:generation]" in headers["description"]
