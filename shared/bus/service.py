"""Running a service process: connect, verify its consumers, run its loops, stop cleanly.

Every service also runs the ``dlq-advisor`` loop (a shared durable consumer, so each
advisory is handled by one process), so exhausted messages are dead-lettered as long as
any service is up. SIGTERM/SIGINT stop fetching, drain in-flight work, close the
connection and return (exit status 0). Tracing is set up from the ``OTEL_*`` environment
(:mod:`shared.telemetry.tracing`); buffered spans are exported before returning.

With ``MeshSettings.metrics_port`` set, the process serves ``/metrics``, ``/healthz`` and
``/readyz`` (:mod:`shared.telemetry.http`) from before it connects until it stops; it is
ready while connected to NATS with every stream and consumer of its loops present.

Per-tenant loops (:class:`TenantLoops`, e.g. the seeder's intake consumer of each tenant)
follow the tenant registry while the service runs: a :class:`TenantSupervisor` reads the
``tenants`` bucket every ``poll_s`` seconds, starts the loops of a tenant that appeared
(once its consumer exists) and stops those of a tenant that was removed — no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from shared.bus.advisories import MaxDeliveriesAdvisory, MaxDeliveriesHandler
from shared.bus.connection import connect
from shared.bus.kvkeys import live_entries
from shared.bus.loop import ConsumeLoop, Handler
from shared.contracts.base import Contract
from shared.settings import MeshSettings
from shared.streams import (
    DLQ_ADVISOR,
    TENANTS_BUCKET,
    ConsumerSpec,
    StreamMissingError,
    verify,
)
from shared.telemetry.http import start_endpoint
from shared.telemetry.tracing import flush_tracing, setup_tracing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSpec:
    """One consume loop of a service: consumer, input model, handler, concurrency."""

    consumer: ConsumerSpec
    model: type[Contract]
    handler: Handler[Any]
    concurrency: int | None = None
    decoder: Callable[[bytes], Any] | None = None


@dataclass(frozen=True)
class TenantLoops:
    """A loop run once per registered tenant: ``factory(tenant_id)`` gives its spec."""

    name: str
    factory: Callable[[str], LoopSpec]
    shared_slots: int | None = None
    """Handlers running at once over every tenant's loop of this kind (None: each loop has
    its own ``concurrency``). With it a tenant with a large backlog takes its turn with the
    others instead of holding every slot: round-robin draining across tenants."""


Setup = Callable[[Client, MeshSettings], Awaitable[Sequence[LoopSpec | TenantLoops]]]
"""Builds a service's loops once connected (handlers get their KV/streams here)."""

Beside = Callable[[Client, MeshSettings, asyncio.Event], Awaitable[None]]
"""A task a service runs beside its loops until the event (stop) is set, e.g. the sink's
JetStream gauges."""


class Readiness:
    """The ``/readyz`` check of one service process: connected, consumers present."""

    def __init__(self) -> None:
        self.nc: Client | None = None
        self.consumers: tuple[ConsumerSpec, ...] = ()
        self.stopping = False

    async def __call__(self) -> str | None:
        """None when ready, else the reason."""
        if self.stopping:
            return "stopping"
        if self.nc is None:
            return "connecting to NATS"
        if not self.nc.is_connected:
            return "not connected to NATS"
        if not self.consumers:
            return "starting"
        try:
            await asyncio.wait_for(verify(self.nc.jetstream(), self.consumers), 5.0)
        except StreamMissingError as error:
            return str(error)
        except Exception as error:  # no answer from JetStream
            return f"JetStream API unavailable: {error!r}"
        return None


async def run_service(name: str, settings: MeshSettings, setup: Setup,
                      stop: asyncio.Event | None = None, beside: Sequence[Beside] = ()) -> None:
    """Run service ``name`` until SIGTERM/SIGINT (or ``stop`` is set).

    Raises:
        shared.streams.StreamMissingError: a consumer it needs does not exist.
    """
    stop = stop or asyncio.Event()
    setup_tracing(name)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    readiness = Readiness()
    endpoint = await start_endpoint(settings.metrics_host, settings.metrics_port, readiness)
    try:
        nc = readiness.nc = await connect(settings, name=f"crawlmesh-{name}")
        try:
            specs = list(await setup(nc, settings))
            js = nc.jetstream()
            specs.append(LoopSpec(DLQ_ADVISOR, MaxDeliveriesAdvisory, MaxDeliveriesHandler(js), 4))
            consumers = tuple(spec.consumer for spec in specs if isinstance(spec, LoopSpec))
            await verify(js, consumers)
            readiness.consumers = consumers
            log.info("service %s running %d loops", name, len(specs))
            await asyncio.gather(run_loops(nc, settings, specs, stop),
                                 *(task(nc, settings, stop) for task in beside))
        finally:
            readiness.stopping = True
            with contextlib.suppress(Exception):
                await nc.drain()
            log.info("service %s stopped", name)
    finally:
        if endpoint is not None:
            await endpoint.close()
        await asyncio.to_thread(flush_tracing)


async def run_loops(nc: Client, settings: MeshSettings, specs: Sequence[LoopSpec | TenantLoops],
                    stop: asyncio.Event, poll_s: float = 1.0) -> None:
    """Run every loop of ``specs`` until ``stop`` is set (per-tenant ones supervised)."""
    loops = [
        ConsumeLoop(nc, s.consumer, s.model, s.handler, settings, stop,
                    concurrency=s.concurrency, decoder=s.decoder)
        for s in specs if isinstance(s, LoopSpec)
    ]
    per_tenant = [s for s in specs if isinstance(s, TenantLoops)]
    supervisor = TenantSupervisor(nc, settings, per_tenant, stop, poll_s)
    await asyncio.gather(*(lp.run() for lp in loops),
                         *([supervisor.run()] if per_tenant else []))


class TenantSupervisor:
    """Keeps one loop per (tenant, :class:`TenantLoops`) running while the tenant exists."""

    def __init__(self, nc: Client, settings: MeshSettings, loops: Sequence[TenantLoops],
                 stop: asyncio.Event, poll_s: float = 1.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.loops = tuple(loops)
        self.stop = stop
        self.poll_s = poll_s
        self.running: dict[tuple[str, str], tuple[asyncio.Event, asyncio.Task[None]]] = {}
        self.pools = {lp.name: asyncio.Semaphore(lp.shared_slots)
                      for lp in self.loops if lp.shared_slots}

    async def tenants(self) -> set[str]:
        """Ids of the registered tenants (keys ``tenant.<id>`` of the ``tenants`` bucket)."""
        kv = await self.js.key_value(TENANTS_BUCKET)
        live = await live_entries(self.js, kv, TENANTS_BUCKET, "tenant.*")  # removed: purged
        return {key.split(".", 1)[1] for key in live}

    async def _still_registered(self, tenant: str) -> bool:
        """True unless ``tenant.<id>`` is confirmed absent (deleted or purged)."""
        kv = await self.js.key_value(TENANTS_BUCKET)
        try:
            entry = await kv.get(f"tenant.{tenant}")
        except KeyNotFoundError:
            return False
        except Exception:  # cannot tell: keep its loops
            return True
        return entry is not None and bool(entry.value)

    async def run(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    await self.refresh(await self.tenants())
                except Exception as error:  # registry unreachable: keep what runs
                    log.warning("cannot read the tenant registry: %r", error)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.poll_s)
        finally:
            for loop_stop, _ in self.running.values():
                loop_stop.set()
            tasks = [task for _, task in self.running.values()]
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def refresh(self, tenants: set[str]) -> None:
        """Start loops of new tenants (consumer present), stop loops of removed ones.

        A tenant missing from the listing is only taken as removed once its record is
        confirmed gone: nats-py's ``kv.keys()`` can come back short under load, and
        stopping a live tenant's loops would stall its crawl.
        """
        running_tenants = {key[0] for key in self.running}
        for tenant in running_tenants - tenants:
            if await self._still_registered(tenant):
                tenants = tenants | {tenant}
        for key, (loop_stop, task) in list(self.running.items()):
            if key[0] not in tenants or task.done():
                loop_stop.set()
                if key[0] not in tenants:
                    log.info("stopping %s loop of removed tenant %s", key[1], key[0])
                await asyncio.gather(task, return_exceptions=True)
                del self.running[key]
        for tenant in sorted(tenants):
            for loops in self.loops:
                if (tenant, loops.name) in self.running:
                    continue
                spec = loops.factory(tenant)
                try:
                    await verify(self.js, (spec.consumer,))
                except StreamMissingError:
                    continue  # tenant being created: its consumer comes next
                loop_stop = asyncio.Event()
                loop = ConsumeLoop(self.nc, spec.consumer, spec.model, spec.handler,
                                   self.settings, loop_stop, concurrency=spec.concurrency,
                                   decoder=spec.decoder, pool=self.pools.get(loops.name))
                log.info("starting %s loop of tenant %s", loops.name, tenant)
                self.running[(tenant, loops.name)] = (loop_stop, asyncio.create_task(loop.run()))
