"""Running a service process: connect, verify its consumers, run its loops, stop cleanly.

Every service also runs the ``dlq-advisor`` loop (a shared durable consumer, so each
advisory is handled by one process), so exhausted messages are dead-lettered as long as
any service is up. SIGTERM/SIGINT stop fetching, drain in-flight work, close the
connection and return (exit status 0).
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
from shared.streams import DLQ_ADVISOR, ConsumerSpec, verify

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


async def run_service(name: str, settings: MeshSettings, setup: Setup,
                      stop: asyncio.Event | None = None) -> None:
    """Run service ``name`` until SIGTERM/SIGINT (or ``stop`` is set).

    Raises:
        shared.streams.StreamMissingError: a consumer it needs does not exist.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    nc = await connect(settings, name=f"crawlmesh-{name}")
    try:
        specs = list(await setup(nc, settings))
        js = nc.jetstream()
        specs.append(LoopSpec(DLQ_ADVISOR, MaxDeliveriesAdvisory, MaxDeliveriesHandler(js), 4))
        await verify(js, tuple(spec.consumer for spec in specs))
        loops = [
            ConsumeLoop(nc, s.consumer, s.model, s.handler, settings, stop,
                        concurrency=s.concurrency, decoder=s.decoder)
            for s in specs
        ]
        log.info("service %s running %d loops", name, len(loops))
        await asyncio.gather(*(lp.run() for lp in loops))
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
        log.info("service %s stopped", name)
