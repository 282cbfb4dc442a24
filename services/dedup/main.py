"""Dedup service entry: wires the KV admission and the job store into the handler."""

from __future__ import annotations

from nats.aio.client import Client

from services.dedup.admission import KvAdmission
from services.dedup.handler import DedupHandler
from shared.bus.service import LoopSpec
from shared.contracts import DiscoveredLinks
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import DEDUP


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    js = nc.jetstream()
    return [LoopSpec(DEDUP, DiscoveredLinks, DedupHandler(KvAdmission(js), JobStore(js)))]
