"""Fetcher service entry: NATS-backed stores, the handler, and the partition loops.

A fetcher serves only the frontier partitions whose lease it holds (one consumer
``fetcher-p<n>`` per partition, pulled by its owner only): :mod:`services.fetcher.leases`
explains the scheme; :class:`PartitionSupervisor` starts and stops the loops as leases
come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from services.fetcher.handler import FRONTIER_ID_STAGE, BeforeFetch, FetcherHandler
from services.fetcher.hoststate import KvHostStore
from services.fetcher.leases import PartitionLeases, new_owner_id
from services.fetcher.settings import FetcherSettings
from shared import subjects
from shared.bus import replays
from shared.bus.loop import ConsumeLoop, Delivery, Outbound
from shared.bus.service import LoopSpec
from shared.contracts import FrontierEntry, JobRecord, JobState
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.streams import ROBOTS_BUCKET, fetcher_partition
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


def build_handler(js: JetStreamContext, settings: MeshSettings,
                  fetcher: FetcherSettings | None = None) -> RunningJobsOnly:
    """The fetcher's handler, guarded (jobs running, tenants not held), with its stores.

    ``http_retries`` is kept below ``max_deliver`` so the last delivery always reports a
    result instead of being dead-lettered.
    """
    fetcher = fetcher or FetcherSettings()
    http_retries = min(fetcher.http_retries, settings.max_deliver - 1)
    if http_retries < fetcher.http_retries:
        log.warning("http_retries lowered to %d to stay below max_deliver %d",
                    http_retries, settings.max_deliver)
    handler = FetcherHandler.build(
        fetcher, robots_store=KvRobotsStore(js), bodies=ObjectStoreBodies(js),
        body_inline_max_bytes=settings.body_inline_max_bytes, http_retries=http_retries,
        host_store=KvHostStore(js),
    )
    concurrency = min(fetcher.concurrency, settings.max_ack_pending)
    return RunningJobsOnly(handler, JobStore(js), TenantGate(js), work_slots=concurrency)


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    """No fixed loops: the fetcher's loops follow its partition leases (:data:`BESIDE`)."""
    return []


async def run_partitions(nc: Client, settings: MeshSettings, stop: asyncio.Event) -> None:
    """Hold a share of the frontier partitions and pull each one held (see
    :mod:`services.fetcher.leases`) until ``stop`` is set; then release them all."""
    fetcher = FetcherSettings()
    js = nc.jetstream()
    guarded = build_handler(js, settings, fetcher)
    leases = PartitionLeases(js, new_owner_id(), fetcher.lease_s)
    guarded.handler.lease_check = lambda host: leases.holds(subjects.partition_of(host))
    slots = min(fetcher.partition_slots + HOLD_SLOTS, settings.max_ack_pending)
    supervisor = PartitionSupervisor(nc, settings, leases, guarded, stop, slots)
    log.info("fetcher %s: lease %.1f s, %d slots per partition", leases.owner,
             fetcher.lease_s, slots)
    try:
        await supervisor.run()
    finally:
        await guarded.handler.politeness.flush()
        await guarded.handler.aclose()


BESIDE = (run_partitions,)
"""What ``crawlmesh service fetcher`` runs beside its (no) fixed loops."""


class PartitionSupervisor:
    """Runs one :class:`ConsumeLoop` per partition this fetcher holds (``fetcher-p<n>``),
    following :meth:`PartitionLeases.tick`; on stop, drains them (their leases still
    renewed meanwhile), then releases every partition."""

    def __init__(self, nc: Client, settings: MeshSettings, leases: PartitionLeases,
                 handler: RunningJobsOnly, stop: asyncio.Event, slots: int) -> None:
        self.nc = nc
        self.settings = settings
        self.leases = leases
        self.handler = handler
        self.stop = stop
        self.slots = slots
        self.loops: dict[int, tuple[asyncio.Event, asyncio.Task[None]]] = {}
        self._releases: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while not self.stop.is_set():
                await self.step()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.leases.tick_s)
        finally:
            await self.shutdown()

    async def step(self) -> None:
        try:
            acquired, to_release = await self.leases.tick()
        except Exception as error:  # leases expire locally: nothing more is fetched
            log.warning("cannot renew partition leases: %r", error)
            return
        for partition in sorted(to_release):
            self._stop_loop(partition)
        for partition in sorted(acquired):
            self.handler.handler.politeness.forget(
                lambda host, p=partition: subjects.partition_of(host) == p)
        for partition in sorted(self.leases.owned()):
            running = self.loops.get(partition)
            if running is None or running[1].done():
                self._start_loop(partition)
        if acquired or to_release:
            log.info("fetcher %s: %d live fetchers, holding %d partitions (+%d -%d)",
                     self.leases.owner, self.leases.live, len(self.leases.owned()),
                     len(acquired), len(to_release))

    def _start_loop(self, partition: int) -> None:
        loop_stop = asyncio.Event()
        loop = ConsumeLoop(self.nc, fetcher_partition(partition), FrontierEntry, self.handler,
                           self.settings, loop_stop, concurrency=self.slots)
        self.loops[partition] = (loop_stop, asyncio.create_task(loop.run()))

    def _stop_loop(self, partition: int) -> None:
        """Stop pulling ``partition``; once its loop drained, release its lease."""
        loop_stop, task = self.loops.pop(partition, (None, None))
        if loop_stop is not None:
            loop_stop.set()

        async def drained() -> None:
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
            # The hosts' last start/end times must be in KV before the next owner reads
            # them: a release with writes still under way would let it start too soon.
            with contextlib.suppress(Exception):
                await self.handler.handler.politeness.flush()
            with contextlib.suppress(Exception):
                await self.leases.release(partition)

        release = asyncio.create_task(drained())
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)

    async def shutdown(self) -> None:
        for held in self.leases.held.values():
            held.releasing = True  # waiting entries are re-published at once
        for partition in list(self.loops):
            self._stop_loop(partition)
        while self._releases:  # keep the leases renewed while the loops drain
            with contextlib.suppress(Exception):
                await self.leases.tick()
            if self._releases:  # the tick may have let the last release finish
                await asyncio.wait(set(self._releases), timeout=self.leases.tick_s)
        await self.leases.leave()


HOLD_SLOTS = 64
"""Extra loop slots in which held tenants' entries wait, so they never take the slots of
fetches for other tenants (fetches stay bounded by ``FetcherSettings.concurrency``)."""


def fetchable(record: JobRecord | None) -> bool:
    """True if an entry of the job of ``record`` is fetched: the job is running, or it has
    completed and the entry is a page replay being handled (:func:`shared.bus.replays.current`)."""
    if record is None:
        return False
    if record.state is JobState.RUNNING:
        return True
    replay = replays.current()
    return record.state is JobState.COMPLETED and replay is not None and replay.page


class RunningJobsOnly:
    """Drops (acks without fetching) frontier entries of jobs that are no longer running:
    a cancelled job fetches nothing more (its state is read at most 2 s old). A page replay
    (``crawlmesh dlq replay``: :mod:`shared.bus.replays`) is fetched while its job is
    running or completed, so the tenant gets the page's result after all.

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
        if not fetchable(record):
            log.info("dropping %s: job %s is not running", entry.url, entry.job_id)
            return "drop"
        if self.holds is not None and await self.holds.hold_reason(entry.tenant) is not None:
            return "hold"
        return None

    async def handle(self, message: FrontierEntry, delivery: Delivery) -> list[Outbound]:
        record = await self.jobs.cached(message.tenant, message.job_id)
        if not fetchable(record):
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
