"""Dedup service entry: wires the KV admission, the job store and the tenant gate.

The loop runs ``concurrency + HOLD_SLOTS`` handlers; admission work is bounded by
``concurrency`` (held tenants' messages wait in the extra slots: see
:mod:`services.dedup.handler`).
"""

from __future__ import annotations

from nats.aio.client import Client

from services.dedup.admission import KvAdmission
from services.dedup.handler import DedupHandler
from shared.bus.service import LoopSpec
from shared.contracts import DiscoveredLinks
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import DEDUP
from shared.tenantgate import HOLD_S, TenantGate

HOLD_SLOTS = 64
"""Extra handler slots for held tenants' messages (bounded by ``max_ack_pending``)."""


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    js = nc.jetstream()
    slots = min(settings.concurrency + HOLD_SLOTS, settings.max_ack_pending)
    handler = DedupHandler(KvAdmission(js), JobStore(js), holds=TenantGate(js), hold_s=HOLD_S,
                           work_slots=settings.concurrency)
    return [LoopSpec(DEDUP, DiscoveredLinks, handler, concurrency=slots)]
