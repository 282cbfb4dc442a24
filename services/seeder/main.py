"""Seeder service entry: one consume loop per tenant intake stream."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError

from services.seeder.handler import RawSubmission, SeederHandler
from shared.bus.service import LoopSpec
from shared.codec import decode, encode
from shared.contracts import JobRecord
from shared.settings import MeshSettings
from shared.streams import JOBS_BUCKET, seeder_consumer
from shared.tenancy import TenantRegistry


class KvJobStore:
    """Job records in the ``jobs`` KV bucket, key ``<tenant>.<job>``."""

    def __init__(self, nc: Client) -> None:
        self.js = nc.jetstream()

    async def create(self, record: JobRecord) -> JobRecord:
        kv = await self.js.key_value(JOBS_BUCKET)
        key = f"{record.tenant}.{record.job_id}"
        try:
            await kv.create(key, encode(record))
            return record
        except KeyWrongLastSequenceError:
            entry = await kv.get(key)
            return decode(entry.value or b"", JobRecord)


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    """One loop per registered tenant's intake stream (``INTAKE_<tenant>``)."""
    handler = SeederHandler(KvJobStore(nc))
    tenants = await TenantRegistry(nc.jetstream()).all()
    return [
        LoopSpec(seeder_consumer(tenant_id), RawSubmission, handler, decoder=RawSubmission)
        for tenant_id in tenants.values()
    ]
