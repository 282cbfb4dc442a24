"""The base of every message model: frozen, no unknown fields, versioned, tenant-scoped."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints


def utc_now() -> datetime:
    """The current time as an aware UTC datetime."""
    return datetime.now(UTC)


def _require_utc(value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("datetime must carry a timezone (UTC)")
    return value.astimezone(UTC)


UtcDatetime = Annotated[datetime, AfterValidator(_require_utc)]
"""An aware datetime, normalised to UTC; naive datetimes are rejected."""


Token = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""A subject token (tenant id, job id): no dots, wildcards or whitespace."""


class Contract(BaseModel):
    """Base of every wire message.

    ``BINARY_FIELD`` names at most one ``bytes`` field that travels out of band, as raw
    bytes after the JSON metadata (see :mod:`shared.codec`), never base64 inside JSON.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64")

    BINARY_FIELD: ClassVar[str | None] = None
    SCHEMA_VERSION: ClassVar[int] = 1
