"""The tenant registry: tenant names mapped to account ids, with status and quota.

A tenant id is the public key of the tenant's NATS account (``A`` + 55 base32 characters),
so subjects never need renaming. The registry lives in the MESH account's ``tenants`` KV
bucket: ``name.<name>`` -> id and ``tenant.<id>`` -> :class:`TenantRecord` (JSON). Only the
control plane (:mod:`shared.accounts.control`, ``crawlmesh tenant …``) writes it; services
read it (the seeder and sink find tenants here; the seeder enforces the crawl limits).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from pydantic import BaseModel, ConfigDict, Field

from shared.accounts.claims import TenantQuota
from shared.bus.kvkeys import live_entries
from shared.streams import TENANTS_BUCKET

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class TenantError(ValueError):
    """An unknown tenant, an invalid tenant name, or a tenant in the wrong state."""


class TenantStatus(StrEnum):
    ACTIVE = "active"
    SUSPENDED = "suspended"


class TenantRecord(BaseModel):
    """A tenant as the registry holds it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    id: str
    status: TenantStatus = TenantStatus.ACTIVE
    quota: TenantQuota = Field(default_factory=TenantQuota)
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    updated_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid tenant name (``[a-z0-9][a-z0-9_-]{0,62}``).

    Raises:
        TenantError: saying why.
    """
    if not _NAME.match(name):
        raise TenantError(f"invalid tenant name {name!r}: use lowercase letters, digits, - and _")
    return name


def looks_like_id(value: str) -> bool:
    return value.startswith("A") and len(value) == 56


class TenantRegistry:
    """Reads (and, for the control plane, writes) tenant records in the ``tenants`` bucket."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def _kv(self):  # type: ignore[no-untyped-def]
        return await self.js.key_value(TENANTS_BUCKET)

    async def get(self, name_or_id: str) -> TenantRecord:
        """The record of a tenant given its name or id.

        Raises:
            TenantError: no such tenant.
        """
        kv = await self._kv()
        tenant_id = name_or_id
        if not looks_like_id(name_or_id):
            try:
                tenant_id = (await kv.get(f"name.{name_or_id}")).value.decode()
            except KeyNotFoundError:
                raise TenantError(f"unknown tenant {name_or_id!r}") from None
        try:
            entry = await kv.get(f"tenant.{tenant_id}")
        except KeyNotFoundError:
            raise TenantError(f"unknown tenant {name_or_id!r}") from None
        return TenantRecord.model_validate_json(entry.value or b"")

    async def resolve(self, name_or_id: str) -> str:
        """The id of a tenant given its name or id.

        Raises:
            TenantError: no such tenant.
        """
        return (await self.get(name_or_id)).id

    async def records(self) -> list[TenantRecord]:
        """Every registered tenant, by name (read fresh)."""
        values = await live_entries(self.js, await self._kv(), TENANTS_BUCKET, "tenant.*")
        out = [TenantRecord.model_validate_json(value) for value in values.values()]
        return sorted(out, key=lambda record: record.name)

    async def all(self) -> dict[str, str]:
        """Every registered tenant as ``{name: id}``."""
        return {record.name: record.id for record in await self.records()}

    async def put(self, record: TenantRecord) -> None:
        """Write ``record`` (control plane only)."""
        kv = await self._kv()
        await kv.put(f"tenant.{record.id}", record.model_dump_json().encode())
        await kv.put(f"name.{record.name}", record.id.encode())

    async def delete(self, record: TenantRecord) -> None:
        """Remove ``record`` (control plane only)."""
        kv = await self._kv()
        for key in (f"name.{record.name}", f"tenant.{record.id}"):
            try:
                await kv.purge(key)
            except KeyNotFoundError:
                pass
