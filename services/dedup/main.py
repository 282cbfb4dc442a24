"""Dedup service entry: wires the KV admission, the job store and the tenant gate.

The loop runs ``concurrency + HOLD_SLOTS`` handlers; admission work is bounded by
``concurrency`` (held tenants' messages wait in the extra slots: see
:mod:`services.dedup.handler`).
"""

from __future__ import annotations

from nats.aio.client import Client

from services.dedup.admission import KvAdmission
from services.dedup.handler import DedupHandler
from shared.bus.service import LoopSpec, TenantLoops
from shared.contracts import DiscoveredLinks
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import dedup_consumer
from shared.tenantgate import HOLD_S, TenantGate

HOLD_SLOTS = 64
"""Extra handler slots for held tenants' messages (bounded by ``max_ack_pending``)."""


async def setup(nc: Client, settings: MeshSettings) -> list[TenantLoops]:
    """One loop per tenant (its own consumer on LINKS); the handler's admission slots
    (``settings.concurrency``) are shared by every tenant and handed out in arrival order,
    so tenants take turns (round-robin draining)."""
    js = nc.jetstream()
    slots = min(settings.concurrency + HOLD_SLOTS, settings.max_ack_pending)
    handler = DedupHandler(KvAdmission(js), JobStore(js), holds=TenantGate(js), hold_s=HOLD_S,
                           work_slots=settings.concurrency)

    def links(tenant: str) -> LoopSpec:
        return LoopSpec(dedup_consumer(tenant), DiscoveredLinks, handler, concurrency=slots)

    return [TenantLoops("dedup", links)]
