"""Wire contracts generated from the models: JSON Schemas and an AsyncAPI 3.0 document.

``proto/`` is generated from :data:`shared.contracts.MESSAGES`, :mod:`shared.subjects` and
:mod:`shared.streams` (``crawlmesh schemas``, or ``python -m shared.schemas``), for tenants
writing clients in other languages; ``tests/unit/test_proto.py`` fails when it drifts::

    proto/schemas/<Model>.json   JSON Schema (draft 2020-12) of each message's JSON
    proto/asyncapi.json          AsyncAPI 3.0: servers, channels, streams, operations

A model with a ``BINARY_FIELD`` travels in the CMB1 envelope of :mod:`shared.codec`: its
schema describes the JSON part only, and ``x-crawlmesh-binary`` names the field whose raw
bytes follow the JSON (never base64 inside it).
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path
from typing import Any

from shared import codec
from shared.contracts import MESSAGES, Contract, CrawlRequest

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_FORMAT = "application/schema+json;version=draft-2020-12"
JSON_CONTENT_TYPE = "application/json"
ENVELOPE_CONTENT_TYPE = "application/vnd.crawlmesh.cmb1"
"""Content type of a message in the CMB1 envelope (JSON metadata + raw bytes)."""

PROTO_DIR = "proto"
SCHEMAS_DIR = "schemas"
FIX_COMMAND = "crawlmesh schemas"

_VALIDATION_MODE: frozenset[type[Contract]] = frozenset({CrawlRequest})
"""Models tenants send: their schema says what is accepted. The rest: what is emitted."""

_BINARY_NOTES = {
    "body": "The page body: raw bytes compressed per body_encoding; empty when the body is "
    "in the Object Store (body_ref) or there is none.",
    "original": "The original message payload, byte for byte, as it was received.",
}

# Sentinels that are valid subject tokens, turned into AsyncAPI {parameters} afterwards.
_TENANT, _JOB = "__tenant__", "__job__"
_SLOTS = {_TENANT: "{tenant}", _JOB: "{job}"}
_EXAMPLE_JOB = "018f3c2a9b1e4d2c7a9f"
_EXAMPLE_FINGERPRINT = "9f86d081884c7d65"


class _PartitionSlot(int):
    """Partition 0 that formats as ``{partition}`` inside a subject."""

    def __format__(self, spec: str) -> str:
        return "{partition}"

    __str__ = __repr__ = lambda self: "{partition}"


def _slots(text: str) -> str:
    for sentinel, slot in _SLOTS.items():
        text = text.replace(sentinel, slot)
    return text


def _summary(model: type[Contract]) -> str:
    return (inspect.getdoc(model) or model.__name__).splitlines()[0]


# ---- JSON Schemas ------------------------------------------------------------------------


def json_schemas() -> dict[str, dict[str, Any]]:
    """One JSON Schema (draft 2020-12) per model in :data:`shared.contracts.MESSAGES`.

    Messages tenants send (:class:`CrawlRequest`) use pydantic's validation-mode schema,
    the rest its serialization-mode schema (what :func:`shared.codec.encode` emits). Each
    has ``$schema``, ``$id`` (``urn:crawlmesh:schema:<Model>:<version>``) and ``title``.
    For a model with a ``BINARY_FIELD`` the field is removed from ``properties`` and
    described under ``x-crawlmesh-binary``, since it travels after the JSON in the CMB1
    envelope.

    Returns:
        ``{model name: schema}`` in :data:`MESSAGES` order.

    Raises:
        pydantic.errors.PydanticUserError: a model cannot be expressed as a JSON Schema.
    """
    return {model.__name__: _schema_of(model) for model in MESSAGES}


def _schema_of(model: type[Contract]) -> dict[str, Any]:
    mode = "validation" if model in _VALIDATION_MODE else "serialization"
    schema: dict[str, Any] = {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": f"urn:crawlmesh:schema:{model.__name__}:{model.SCHEMA_VERSION}",
        **model.model_json_schema(mode=mode),
        "title": model.__name__,
        "$comment": f"Generated from {model.__module__}.{model.__qualname__} ({mode} mode) "
        f"by shared.schemas; do not edit, run `{FIX_COMMAND}`.",
    }
    field = model.BINARY_FIELD
    if field is not None:
        schema["properties"].pop(field)
        if field in schema.get("required", ()):
            schema["required"].remove(field)
        schema["x-crawlmesh-binary"] = _binary_note(model)
        schema["description"] = (
            f"{schema.get('description', '')}\n\nWire format: the CMB1 envelope "
            f"({ENVELOPE_CONTENT_TYPE}): {_layout(field)}. `{field}` is not a JSON property."
        ).strip()
    return schema


def _layout(field: str) -> str:
    return (f'b"{codec.MAGIC.decode()}" | uint32 big-endian length of the JSON | the JSON '
            f"(this schema, without {field}) | raw bytes of {field}")


def _binary_note(model: type[Contract]) -> dict[str, str]:
    field = model.BINARY_FIELD or ""
    description = model.model_fields[field].description or _BINARY_NOTES.get(field, "")
    return {"field": field, "type": "bytes", "envelope": codec.MAGIC.decode(),
            "contentType": ENVELOPE_CONTENT_TYPE, "layout": _layout(field),
            "description": description}


# ---- files -------------------------------------------------------------------------------


def render_proto() -> dict[str, str]:
    """Every generated file's text: sorted keys, 2-space indent, trailing newline.

    Returns:
        ``{POSIX path relative to the repository root: text}``, sorted by path, e.g.
        ``proto/asyncapi.json`` and ``proto/schemas/FetchedPage.json``.
    """
    docs = {f"{PROTO_DIR}/{SCHEMAS_DIR}/{name}.json": schema
            for name, schema in json_schemas().items()}
    from shared.asyncapi import asyncapi  # imported here: it builds on this module

    docs[f"{PROTO_DIR}/asyncapi.json"] = asyncapi()
    return {path: json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
            for path, doc in sorted(docs.items())}


def _existing(root: Path) -> set[str]:
    proto = root / PROTO_DIR
    paths = [*proto.glob("*.json"), *(proto / SCHEMAS_DIR).glob("*.json")]
    return {p.relative_to(root).as_posix() for p in paths if p.is_file()}


def write_proto(root: Path) -> list[Path]:
    """Write ``proto/`` under the repository root ``root`` and delete stale ``*.json``.

    Args:
        root: the repository root (``proto/`` is created under it if missing).

    Returns:
        The paths of every generated file (written as UTF-8), sorted.

    Raises:
        OSError: a file could not be written or a stale one removed.
    """
    files = render_proto()
    for stale in sorted(_existing(root) - files.keys()):
        (root / stale).unlink()
    written = []
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode())
        written.append(path)
    return written


def check_proto(root: Path) -> list[str]:
    """Compare ``proto/`` under the repository root ``root`` with what would be generated.

    Args:
        root: the repository root.

    Returns:
        Sorted POSIX paths relative to ``root`` of files that differ, are missing, or are
        extra ``*.json`` in ``proto/`` or ``proto/schemas/``; empty when up to date.

    Raises:
        OSError: a file exists but cannot be read.
    """
    files = render_proto()
    drifted = {rel for rel, text in files.items()
               if not (root / rel).is_file() or (root / rel).read_bytes() != text.encode()}
    return sorted(drifted | (_existing(root) - files.keys()))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    for written_path in write_proto(target):
        print(written_path)
