"""Storage quotas without loss: a tenant whose RESULTS is full (or gone) gets its pages
parked, a quota event and its admission paused; the parked pages drain exactly once when
the quota is raised or the tenant deletes results, and the job then completes.

Real nats-server in operator mode, the sink's loops (per-tenant parked loops included) as
the service runs them; the tenant is a real account with a tiny storage quota.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError

from services.dedup.admission import KvAdmission
from services.dedup.handler import DedupHandler
from services.sink.main import setup
from shared import subjects
from shared.accounts.claims import TenantQuota
from shared.accounts.control import TenantControl
from shared.bus.loop import Delivery
from shared.bus.service import run_loops
from shared.codec import encode
from shared.contracts import DiscoveredLinks, JobEventKind, JobState, Link, LinkOrigin
from shared.jobs import JobStore, ledger_counts
from shared.settings import MeshSettings
from shared.streams import DLQ, PARKED, RESULTS
from shared.tenantgate import TenantGate
from tests.conftest import tenant_js
from tests.integration.test_sink import Crawl, eventually

STORAGE = 256 << 10
"""The tenant's quota: RESULTS gets 192 KiB of it, EVENTS 64 KiB."""
PAGES = ("/a", "/b", "/c", "/d", "/e")


@pytest.fixture
async def small(settings: MeshSettings, nc: Client) -> str:
    """Tenant ``small`` with a 256 KiB storage quota."""
    async with TenantControl.open(settings) as control:
        return (await control.add("small", TenantQuota(storage_bytes=STORAGE))).id


@pytest.fixture
async def tjs(settings: MeshSettings, small: str) -> AsyncIterator[JetStreamContext]:
    """JetStream inside the tenant's own account."""
    async with tenant_js(settings, "small") as tjs_:
        yield tjs_


@pytest.fixture
async def sink_loops(nc: Client, settings: MeshSettings, small: str) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_loops(nc, settings, await setup(nc, settings), stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)


async def fill(js: JetStreamContext, tenant: str) -> list[int]:
    """Fill the tenant's RESULTS to the brim (as MESH); the filler's sequences."""
    seqs: list[int] = []
    for size in (4096, 512, 64):
        while True:
            try:
                ack = await js.publish(subjects.results(tenant, "filler"), b"x" * size)
            except APIError as error:
                assert error.err_code in (10077, 10002), error
                break
            seqs.append(ack.seq)
    return seqs


async def crawl_into_full_tenant(js: JetStreamContext, tjs: JetStreamContext,
                                 tenant: str, job: str) -> Crawl:
    """A job of seed ``/`` and pages :data:`PAGES` sent through the sink's streams."""
    crawl = Crawl(js, tenant, job, tjs)
    await crawl.start()
    reports = [await crawl.admit(None, "/"), await crawl.admit("/", *PAGES)]
    reports += [await crawl.admit(path) for path in PAGES]
    for n, report in enumerate(reports):
        await js.publish(subjects.expanded(tenant, job), encode(report),
                         headers={"Nats-Msg-Id": f"test-expanded-{n}"})
    for path in ("/", *PAGES):
        await js.publish(subjects.parsed(tenant, job),
                         encode(crawl.parsed(path, 0 if path == "/" else 1)),
                         headers={"Nats-Msg-Id": f"test-parsed-{path}"})
    return crawl


async def parked_count(js: JetStreamContext, tenant: str) -> int:
    info = await js.stream_info(PARKED.name, subjects_filter=f"mesh.parked.{tenant}.>")
    return sum((info.state.subjects or {}).values())


async def assert_parked_and_paused(js: JetStreamContext, crawl: Crawl,
                                   settings: MeshSettings) -> str:
    """Every page parked, none lost or dead-lettered, admission paused, the job told
    once; the reason the job was told."""
    tenant = crawl.tenant

    async def all_parked() -> bool:
        return await parked_count(js, tenant) == 1 + len(PAGES)

    await eventually(all_parked, "every page to be parked")

    async def told() -> list[str]:
        return [e.reason or "" for e in await crawl.events(settings)
                if e.kind is JobEventKind.PROGRESS]

    (reason,) = await eventually(told, "the pause event")
    assert await crawl.results(settings) == []
    assert (await js.stream_info(DLQ.name)).state.messages == 0
    assert (await js.stream_info("PARSED")).state.messages == 0  # acked, not retried
    counts = await ledger_counts(js, tenant, crawl.job)
    assert counts.finished == 0 and counts.admitted == 1 + len(PAGES)
    assert (await crawl.record()).state is JobState.RUNNING
    hold = await TenantGate(js).hold_reason(tenant)
    assert hold is not None and hold.startswith("admission paused: ")
    return reason


async def assert_drained_once(js: JetStreamContext, crawl: Crawl,
                              settings: MeshSettings) -> None:
    async def completed() -> list[object]:
        return [e for e in await crawl.events(settings) if e.kind is JobEventKind.COMPLETED]

    (event,) = await eventually(completed, "the job to complete after draining", 30)
    assert event.counters.finished == event.counters.admitted == 1 + len(PAGES)  # type: ignore[attr-defined]
    results = await crawl.results(settings)
    assert sorted(r.url.removeprefix("https://site.test") for r in results) == sorted(
        ["/", *PAGES])
    assert (await js.stream_info(DLQ.name)).state.messages == 0

    async def parked_acked() -> bool:  # the last parked page is acked after it completes the job
        return await parked_count(js, crawl.tenant) == 0

    await eventually(parked_acked, "the parked backlog to be acked")

    async def resumed() -> bool:
        return await TenantGate(js, ttl_s=0).hold_reason(crawl.tenant) is None

    await eventually(resumed, "the pause to be lifted")


async def test_a_full_tenant_parks_pages_and_drains_them_when_the_quota_is_raised(
    js: JetStreamContext, tjs: JetStreamContext, small: str, job: str,
    settings: MeshSettings, sink_loops: None,
) -> None:
    await fill(js, small)
    crawl = await crawl_into_full_tenant(js, tjs, small, job)
    reason = await assert_parked_and_paused(js, crawl, settings)

    match = re.search(r"storage quota exceeded: (\d+) of (\d+) bytes used", reason)
    assert match, reason
    used = (await tjs.stream_info(RESULTS)).state.bytes
    assert (int(match[1]), int(match[2])) == (used, STORAGE)

    async with TenantControl.open(settings) as control:
        await control.update("small", storage_bytes=4 * STORAGE)
    await assert_drained_once(js, crawl, settings)


async def test_parked_pages_drain_when_the_tenant_deletes_consumed_results(
    js: JetStreamContext, tjs: JetStreamContext, small: str, job: str,
    settings: MeshSettings, sink_loops: None,
) -> None:
    filler = await fill(js, small)
    crawl = await crawl_into_full_tenant(js, tjs, small, job)
    await assert_parked_and_paused(js, crawl, settings)

    for seq in filler:  # the tenant consumed these and deletes them
        await tjs.delete_msg(RESULTS, seq)
    await assert_drained_once(js, crawl, settings)


async def test_a_deleted_results_stream_parks_pages_with_an_event_that_says_so(
    js: JetStreamContext, tjs: JetStreamContext, small: str, job: str,
    settings: MeshSettings, sink_loops: None,
) -> None:
    async with TenantControl.open(settings) as control:
        record = await control.registry.get("small")
        async with control.tenant_connection(record) as admin:
            await admin.jetstream().delete_stream(RESULTS)
    crawl = await crawl_into_full_tenant(js, tjs, small, job)
    reason = await assert_parked_and_paused(js, crawl, settings)
    assert "RESULTS stream is missing" in reason

    async with TenantControl.open(settings) as control:  # recreates RESULTS
        await control.update("small", storage_bytes=STORAGE)
    await assert_drained_once(js, crawl, settings)


async def test_dedup_holds_a_paused_tenant_and_republishes_under_a_new_msg_id(
    js: JetStreamContext, small: str, job: str,
) -> None:
    crawl = Crawl(js, small, job, js)
    await crawl.start()
    gate = TenantGate(js, ttl_s=0.1)
    await gate.set_pause(small, job, "storage quota exceeded: 1 of 1 bytes used")
    handler = DedupHandler(KvAdmission(js), JobStore(js), holds=gate, hold_s=0.3)
    links = DiscoveredLinks(tenant=small, job_id=job, origin=LinkOrigin.SEED, depth=0,
                            links=(Link(url="https://site.test/"),))
    delivery = Delivery(subject=subjects.links(small, job),
                        headers={"Nats-Msg-Id": f"seeder:{small}:{job}:seeds"}, delivered=1,
                        stream_seq=42, tenant=small, job=job)
    (held,) = await handler.handle(links, delivery)
    assert (held.subject, held.message) == (subjects.links(small, job), links)
    assert held.msg_id == f"seeder:{small}:{job}:seeds:held-42"
    again = dataclasses.replace(delivery, headers={"Nats-Msg-Id": held.msg_id}, stream_seq=43)
    (held_again,) = await handler.handle(links, again)
    assert held_again.msg_id == f"seeder:{small}:{job}:seeds:held-43"  # no growing ids
    assert (await ledger_counts(js, small, job)).admitted == 0

    pause = await gate.pause(small, fresh=True)
    assert pause is not None and await gate.clear(small, pause)
    outputs = await handler.handle(links, delivery)
    assert any(o.subject == subjects.expanded(small, job) for o in outputs)  # admitted now
