"""Running a service process: connect, verify its consumers, run its loops, stop cleanly.

Every service also runs the ``dlq-advisor`` loop (a shared durable consumer, so each
advisory is handled by one process), so exhausted messages are dead-lettered as long as
any service is up. SIGTERM/SIGINT stop fetching, drain in-flight work, close the
connection and return (exit status 0). Tracing is set up from the ``OTEL_*`` environment
(:mod:`shared.telemetry.tracing`); buffered spans are exported before returning.

With ``MeshSettings.metrics_port`` set, the process serves ``/metrics``, ``/healthz`` and
``/readyz`` (:mod:`shared.telemetry.http`) from before it connects until it stops; it is
ready while connected to NATS with every stream and consumer of its loops present.
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

from shared.bus.advisories import MaxDeliveriesAdvisory, MaxDeliveriesHandler
from shared.bus.connection import connect
from shared.bus.loop import ConsumeLoop, Handler
from shared.contracts.base import Contract
from shared.settings import MeshSettings
from shared.streams import DLQ_ADVISOR, ConsumerSpec, StreamMissingError, verify
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


Setup = Callable[[Client, MeshSettings], Awaitable[Sequence[LoopSpec]]]
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
            consumers = tuple(spec.consumer for spec in specs)
            await verify(js, consumers)
            readiness.consumers = consumers
            loops = [
                ConsumeLoop(nc, s.consumer, s.model, s.handler, settings, stop,
                            concurrency=s.concurrency, decoder=s.decoder)
                for s in specs
            ]
            log.info("service %s running %d loops", name, len(loops))
            await asyncio.gather(*(lp.run() for lp in loops),
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
