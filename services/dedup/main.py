"""Dedup service entry."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError

from services.dedup.handler import DedupHandler
from shared.bus.service import LoopSpec
from shared.contracts import DiscoveredLinks
from shared.settings import MeshSettings
from shared.streams import DEDUP, PAGES_BUCKET


class KvSeenSet:
    """The seen-set in the ``pages`` KV bucket: key ``<tenant>.<job>.<fingerprint>``,
    value ``admitted <msg id of the admitting message>``."""

    def __init__(self, nc: Client) -> None:
        self.js = nc.jetstream()

    async def admit(self, tenant: str, job: str, fingerprint: str, admitted_by: str) -> bool:
        kv = await self.js.key_value(PAGES_BUCKET)
        key = f"{tenant}.{job}.{fingerprint}"
        try:
            await kv.create(key, f"admitted {admitted_by}".encode())
            return True
        except KeyWrongLastSequenceError:
            entry = await kv.get(key)
            return (entry.value or b"").decode() == f"admitted {admitted_by}"


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    return [LoopSpec(DEDUP, DiscoveredLinks, DedupHandler(KvSeenSet(nc)))]
