"""Seeder service entry: one consume loop per tenant intake stream."""

from __future__ import annotations

from nats.aio.client import Client

from services.seeder.handler import RawSubmission, SeederHandler
from shared.bus.service import LoopSpec
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import seeder_consumer
from shared.tenancy import TenantRegistry


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    """One loop per registered tenant's intake stream (``INTAKE_<tenant>``)."""
    js = nc.jetstream()
    handler = SeederHandler(JobStore(js))
    tenants = await TenantRegistry(js).all()
    return [
        LoopSpec(seeder_consumer(tenant_id), RawSubmission, handler, decoder=RawSubmission)
        for tenant_id in tenants.values()
    ]
