"""Wire encoding of contracts: JSON, plus raw bytes out of band for the one binary field.

A model without a binary field is its JSON (orjson). A model with one (``BINARY_FIELD``)
is an envelope::

    b"CMB1" | uint32 big-endian length of the JSON | JSON without the field | raw bytes

so a page body travels as the compressed bytes themselves, never base64 inside JSON.
"""

from __future__ import annotations

import struct
import zlib
from typing import TypeVar

import orjson
from pydantic import ValidationError

from shared.contracts.base import Contract

MAGIC = b"CMB1"
_LEN = struct.Struct(">I")

M = TypeVar("M", bound=Contract)


class DecodeError(ValueError):
    """A payload is not a valid message of the expected type; the reason says why."""


def encode(message: Contract) -> bytes:
    """Serialise ``message`` to its wire bytes (see module docstring)."""
    field = message.BINARY_FIELD
    if field is None:
        return orjson.dumps(message.model_dump(mode="json"))
    meta = orjson.dumps(message.model_dump(mode="json", exclude={field}))
    return b"".join((MAGIC, _LEN.pack(len(meta)), meta, getattr(message, field)))


def decode(payload: bytes, model: type[M]) -> M:
    """Parse wire bytes into ``model``.

    Raises:
        DecodeError: invalid JSON, a missing envelope, or a model validation error; the
            message says which field and why.
    """
    field = model.BINARY_FIELD
    try:
        if field is None:
            data = orjson.loads(payload)
            if not isinstance(data, dict):
                raise DecodeError(f"expected a JSON object for {model.__name__}")
            return model.model_validate(data)
        if payload[:4] != MAGIC or len(payload) < 8:
            raise DecodeError(f"{model.__name__} payload lacks the CMB1 envelope")
        (size,) = _LEN.unpack_from(payload, 4)
        if 8 + size > len(payload):
            raise DecodeError(f"{model.__name__} envelope is truncated")
        data = orjson.loads(payload[8 : 8 + size])
        if not isinstance(data, dict):
            raise DecodeError(f"expected a JSON object for {model.__name__}")
        data[field] = payload[8 + size :]
        return model.model_validate(data)
    except orjson.JSONDecodeError as error:
        raise DecodeError(f"invalid JSON for {model.__name__}: {error}") from None
    except ValidationError as error:
        raise DecodeError(describe(error, model.__name__)) from None


def describe(error: ValidationError, what: str) -> str:
    """One line naming each invalid field and why, for rejections and dead letters."""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in item['loc']) or '(root)'}: {item['msg']}"
        for item in error.errors(include_url=False)
    )
    return f"invalid {what}: {problems}"


def compress(body: bytes) -> bytes:
    """zlib-compress a page body (level 1: bodies are many, CPU is scarce)."""
    return zlib.compress(body, 1)


def decompress(body: bytes, encoding: str, max_bytes: int | None = None) -> bytes:
    """Undo :func:`compress` for ``encoding`` ``zlib`` (``identity`` passes through).

    Raises:
        DecodeError: unknown encoding, corrupt data, or output above ``max_bytes``.
    """
    if encoding == "identity":
        return body
    if encoding != "zlib":
        raise DecodeError(f"unknown body encoding {encoding!r}")
    try:
        inflater = zlib.decompressobj()
        out = inflater.decompress(body, max_bytes or 0)
    except zlib.error as error:
        raise DecodeError(f"corrupt zlib body: {error}") from None
    if inflater.unconsumed_tail:
        raise DecodeError(f"body inflates beyond {max_bytes} bytes")
    return out
