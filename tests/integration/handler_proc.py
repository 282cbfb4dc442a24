"""A handler process for the consume-loop tests: a real service process the tests can kill.

Run as ``python handler_proc.py <mode> [args]`` with ``CRAWLMESH_*`` settings in the
environment and the tenant id in ``TEST_TENANT``. It consumes that tenant's dedup consumer
of ``LINKS`` (input
:class:`DiscoveredLinks`) and reports what it does on stdout, one line per event, so the
test can wait on events instead of sleeping:

``hang-last``
    Fails (``TransientError``, retry in 0.1 s) every delivery but the last, prints
    ``hanging <seq> <delivered>`` on the last one and blocks until killed.
``drain <delay_s> <hang>``
    Runs :func:`shared.bus.service.run_service` with a handler that prints
    ``start <url>``, sleeps ``delay_s`` (forever for a URL containing ``hang`` when
    ``hang`` is 1), publishes one :class:`FrontierEntry` per link and prints
    ``done <url>``; prints ``exited`` after a clean stop (SIGTERM) and exits 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from nats.aio.client import Client

from shared import streams, subjects
from shared.bus.connection import connect
from shared.bus.loop import ConsumeLoop, Delivery, Outbound
from shared.bus.outcomes import TransientError
from shared.bus.service import LoopSpec, run_service
from shared.contracts import DiscoveredLinks, FrontierEntry
from shared.settings import MeshSettings
from shared.subjects import Stage


def report(*words: object) -> None:
    print(*words, flush=True)


def fingerprint(url: str) -> str:
    return hashlib.blake2b(url.encode(), digest_size=8).hexdigest()


def frontier_outputs(message: DiscoveredLinks) -> list[Outbound]:
    """One frontier entry per link, with the deterministic dedup-stage message id."""
    outputs = []
    for link in message.links:
        host = urlsplit(link.url).hostname or "unknown"
        fp = fingerprint(link.url)
        entry = FrontierEntry(tenant=message.tenant, job_id=message.job_id, url=link.url,
                              fingerprint=fp, host=host, depth=message.depth)
        outputs.append(Outbound(
            subjects.frontier(subjects.partition_of(host), message.tenant, message.job_id),
            entry, subjects.msg_id(Stage.DEDUP, message.tenant, message.job_id, fp),
        ))
    return outputs


class HangOnLastDelivery:
    def __init__(self, max_deliver: int) -> None:
        self.max_deliver = max_deliver

    async def handle(self, message: DiscoveredLinks, delivery: Delivery) -> Sequence[Outbound]:
        if delivery.delivered < self.max_deliver:
            report("failing", delivery.stream_seq, delivery.delivered)
            raise TransientError("not yet", retry_after_s=0.1)
        report("hanging", delivery.stream_seq, delivery.delivered)
        await asyncio.Event().wait()
        return []


class SlowForwarder:
    def __init__(self, delay_s: float, hang: bool) -> None:
        self.delay_s = delay_s
        self.hang = hang

    async def handle(self, message: DiscoveredLinks, delivery: Delivery) -> Sequence[Outbound]:
        url = message.links[0].url
        report("start", url)
        if self.hang and "hang" in url:
            await asyncio.Event().wait()
        await asyncio.sleep(self.delay_s)
        report("done", url)
        return frontier_outputs(message)


async def hang_last(settings: MeshSettings, tenant: str) -> None:
    nc: Client = await connect(settings, name="crawlmesh-test-hang")
    loop = ConsumeLoop(nc, streams.dedup_consumer(tenant), DiscoveredLinks,
                       HangOnLastDelivery(settings.max_deliver), settings, asyncio.Event())
    report("ready")
    await loop.run()


async def drain(settings: MeshSettings, tenant: str, delay_s: float, hang: bool) -> None:
    async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
        return [LoopSpec(streams.dedup_consumer(tenant), DiscoveredLinks,
                         SlowForwarder(delay_s, hang))]

    report("ready")
    await run_service("drain-test", settings, setup)
    report("exited")


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = MeshSettings()
    tenant = os.environ["TEST_TENANT"]
    match argv:
        case ["hang-last"]:
            asyncio.run(hang_last(settings, tenant))
        case ["drain", delay_s, hang]:
            asyncio.run(drain(settings, tenant, float(delay_s), hang == "1"))
        case _:
            raise SystemExit(f"usage: handler_proc.py hang-last | drain <delay_s> <0|1>: {argv}")


if __name__ == "__main__":
    main(sys.argv[1:])
