"""Seeder service entry: one consume loop per tenant intake stream, following the registry.

A tenant added while the seeder runs gets its loop within about a second; a removed
tenant's loop stops (:class:`shared.bus.service.TenantLoops`). Each tenant's submissions
are handled one at a time, so its concurrent-jobs limit is checked against settled counts.
"""

from __future__ import annotations

from nats.aio.client import Client

from services.seeder.handler import RawSubmission, SeederHandler
from shared.bus.service import LoopSpec, TenantLoops
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import seeder_consumer
from shared.tenantgate import TenantGate


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec | TenantLoops]:
    """The intake loop of every registered tenant (``INTAKE_<tenant>``), one at a time."""
    js = nc.jetstream()
    handler = SeederHandler(JobStore(js), TenantGate(js))

    def intake(tenant_id: str) -> LoopSpec:
        return LoopSpec(seeder_consumer(tenant_id), RawSubmission, handler, concurrency=1,
                        decoder=RawSubmission)

    return [TenantLoops("seeder", intake)]
