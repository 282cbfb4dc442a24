"""Fetcher service entry: NATS-backed stores for robots.txt and bodies, and the handler."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from services.fetcher.handler import FRONTIER_ID_STAGE, BeforeFetch, FetcherHandler
from services.fetcher.settings import FetcherSettings
from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.bus.service import LoopSpec
from shared.contracts import FrontierEntry, JobState
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import FETCHER, ROBOTS_BUCKET
from shared.tenantgate import HOLD_S, TenantGate

log = logging.getLogger(__name__)


class KvRobotsStore:
    """robots.txt records in the ``robots`` KV bucket (the bucket's TTL expires them)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def get(self, key: str) -> bytes | None:
        kv = await self.js.key_value(ROBOTS_BUCKET)
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # includes deleted and purged keys
            return None
        return entry.value

    async def put(self, key: str, value: bytes) -> None:
        kv = await self.js.key_value(ROBOTS_BUCKET)
        await kv.put(key, value)


class ObjectStoreBodies:
    """Large bodies in the tenant's Object Store bucket (created by ``ensure_tenant``)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def put(self, bucket: str, name: str, data: bytes) -> None:
        store = await self.js.object_store(bucket)
        await store.put(name, data)


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    """The fetcher's loop over the ``fetcher`` consumer of ``FRONTIER``.

    ``http_retries`` is kept below ``max_deliver`` so the last delivery always reports a
    result instead of being dead-lettered.
    """
    fetcher = FetcherSettings()
    js = nc.jetstream()
    http_retries = min(fetcher.http_retries, settings.max_deliver - 1)
    if http_retries < fetcher.http_retries:
        log.warning("http_retries lowered to %d to stay below max_deliver %d",
                    http_retries, settings.max_deliver)
    handler = FetcherHandler.build(
        fetcher, robots_store=KvRobotsStore(js), bodies=ObjectStoreBodies(js),
        body_inline_max_bytes=settings.body_inline_max_bytes, http_retries=http_retries,
    )
    concurrency = min(fetcher.concurrency, settings.max_ack_pending)
    slots = min(concurrency + HOLD_SLOTS, settings.max_ack_pending)
    guarded = RunningJobsOnly(handler, JobStore(js), TenantGate(js), work_slots=concurrency)
    return [LoopSpec(FETCHER, FrontierEntry, guarded, concurrency=slots)]


HOLD_SLOTS = 64
"""Extra loop slots in which held tenants' entries wait, so they never take the slots of
fetches for other tenants (fetches stay bounded by ``FetcherSettings.concurrency``)."""


class RunningJobsOnly:
    """Drops (acks without fetching) frontier entries of jobs that are no longer running:
    a cancelled job fetches nothing more (its state is read at most 2 s old).

    Entries of a held tenant (suspended, or paused because its results are parked:
    :mod:`shared.tenantgate`) are held ``hold_s`` seconds and, if the tenant is still held,
    re-published with ``generation + 1`` like a deferred entry (never nak'd, which would
    count towards ``max_deliver``)."""

    def __init__(self, handler: FetcherHandler, jobs: JobStore, holds: TenantGate | None = None,
                 hold_s: float = HOLD_S, work_slots: int | None = None) -> None:
        self.handler = handler
        self.jobs = jobs
        self.holds = holds
        self.hold_s = hold_s
        self._work = asyncio.Semaphore(work_slots) if work_slots else None
        handler.before_fetch = self.before_fetch

    async def before_fetch(self, entry: FrontierEntry) -> BeforeFetch:
        """Checked again when the entry's turn has come (after its politeness wait): its
        job may have been cancelled, or its tenant suspended or paused, meanwhile."""
        record = await self.jobs.cached(entry.tenant, entry.job_id)
        if record is None or record.state is not JobState.RUNNING:
            log.info("dropping %s: job %s is not running", entry.url, entry.job_id)
            return "drop"
        if self.holds is not None and await self.holds.hold_reason(entry.tenant) is not None:
            return "hold"
        return None

    async def handle(self, message: FrontierEntry, delivery: Delivery) -> list[Outbound]:
        record = await self.jobs.cached(message.tenant, message.job_id)
        if record is None or record.state is not JobState.RUNNING:
            log.info("dropping %s: job %s is not running", message.url, message.job_id)
            return []
        if self.holds is not None:
            reason = await self.holds.wait_released(message.tenant, self.hold_s)
            if reason is not None:
                return [self.held(message)]
        if self._work is None:
            return await self.handler.handle(message, delivery)
        async with self._work:
            return await self.handler.handle(message, delivery)

    @staticmethod
    def held(entry: FrontierEntry) -> Outbound:
        """``entry`` re-published to its frontier subject under the next generation."""
        generation = entry.generation + 1
        return Outbound(
            subjects.frontier(subjects.partition_of(entry.host), entry.tenant, entry.job_id),
            entry.model_copy(update={"generation": generation}),
            subjects.msg_id(FRONTIER_ID_STAGE, entry.tenant, entry.job_id, entry.fingerprint,
                            generation),
        )
