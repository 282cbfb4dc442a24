"""A service's /healthz, /readyz and /metrics, and the sink's quota-error counter, against
a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

import httpx
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from services.sink.main import JetStreamPublisher
from shared import streams, subjects
from shared.accounts.control import TenantControl
from shared.bus.loop import Delivery, Outbound
from shared.bus.outcomes import TransientError
from shared.bus.service import LoopSpec, run_service
from shared.contracts import DiscoveredLinks, JobEvent, JobEventKind
from shared.settings import MeshSettings
from shared.telemetry import metrics
from shared.telemetry.http import TelemetryServer
from tests.sites import free_port

pytestmark = pytest.mark.timeout(60)


class Nothing:
    async def handle(self, message: DiscoveredLinks, delivery: Delivery) -> Sequence[Outbound]:
        return []


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(url)


async def until(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` every 50 ms (an HTTP probe has no event to wait on)."""
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not true after {timeout_s}s")


async def test_readyz_follows_the_consumers_of_the_service(
    settings: MeshSettings, js: JetStreamContext, tenant: str
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()

    async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
        return [LoopSpec(streams.dedup_consumer(tenant), DiscoveredLinks, Nothing())]

    service = asyncio.create_task(run_service(
        "probe-test", settings.model_copy(update={"metrics_port": port}), setup, stop))
    try:
        async def ready() -> bool:
            with contextlib.suppress(httpx.TransportError):
                return (await get(f"{base}/readyz")).status_code == 200
            return False

        await until(ready)
        assert (await get(f"{base}/healthz")).text == "ok\n"
        assert "crawlmesh_handler_duration_seconds" in (await get(f"{base}/metrics")).text

        dedup = streams.dedup_consumer(tenant)
        await js.delete_consumer(dedup.stream, dedup.durable)
        answer = await get(f"{base}/readyz")
        assert answer.status_code == 503
        assert f"consumer {dedup.durable} on LINKS does not exist" in answer.text

        await streams.ensure_consumer(js, streams.dedup_consumer(tenant), settings)
        assert (await get(f"{base}/readyz")).status_code == 200
    finally:
        stop.set()
        await asyncio.wait_for(service, 20)
    with pytest.raises(httpx.TransportError):  # the endpoint stops with the service
        await get(f"{base}/healthz")


async def test_readiness_reason_and_unknown_paths() -> None:
    async def not_yet() -> str | None:
        return "connecting to NATS"

    server = await TelemetryServer("127.0.0.1", 0, not_yet).start()
    try:
        answer = await get(f"{server.url}/readyz")
        assert (answer.status_code, answer.text) == (503, "not ready: connecting to NATS\n")
        assert (await get(f"{server.url}/healthz")).status_code == 200
        assert (await get(f"{server.url}/metrics?x=1")).status_code == 200
        assert (await get(f"{server.url}/")).status_code == 404
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.post(f"{server.url}/metrics")).status_code == 405
    finally:
        await server.close()


async def test_a_full_tenant_stream_counts_a_quota_error(
    settings: MeshSettings, js: JetStreamContext, tenant: str, job: str
) -> None:
    async with TenantControl.open(settings) as control:  # RESULTS: 600 bytes
        await control.update(tenant, storage_bytes=1200)
    publisher = JetStreamPublisher(js)
    event = JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.PROGRESS)
    before = metrics.QUOTA_ERRORS.labels(tenant)._value.get()

    async def fill() -> None:
        for n in range(100):
            await publisher.publish(subjects.results(tenant, job), event, f"{job}-{n}")

    with pytest.raises(TransientError):
        await fill()
    assert metrics.QUOTA_ERRORS.labels(tenant)._value.get() == before + 1
    assert await publisher.publish(subjects.events(tenant, job), event, "once") is True
    assert await publisher.publish(subjects.events(tenant, job), event, "once") is False
