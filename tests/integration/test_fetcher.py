"""The fetcher service loop against a real nats-server and a real loopback site.

Frontier entries go in on ``mesh.frontier.<p>.<tenant>.<job>``; fetched pages come out on
``FETCHED`` (nothing consumes them here); robots.txt lands in the ``robots`` KV bucket and
a large body in the tenant's Object Store bucket. Waits are polls with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.fetcher import main as fetcher_main
from services.fetcher.handler import ROBOTS_DISALLOWS, FetcherHandler
from services.fetcher.robots import RobotsRules, RobotsVerdict, origin_of, store_key
from shared import streams, subjects
from shared.codec import decode, decompress, encode
from shared.contracts import (
    CrawlRequest,
    DiscoveredLinks,
    FetchedPage,
    FrontierEntry,
    JobRecord,
    LinkOrigin,
    ParsedPage,
    utc_now,
)
from shared.jobs import JobStore
from shared.settings import MeshSettings
from shared.subjects import Stage
from shared.urls import canonical_url, fingerprint, host_of
from tests.sites import Site, html


@pytest.fixture
def site() -> Iterator[Site]:
    site = Site()
    site.pages = {
        "/robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /private\n"),
        "/": (200, "text/html", html("home", "Home")),
        "/big": (200, "text/html", html(os.urandom(20_000).hex(), "Big")),
        "/private": (200, "text/html", html("secret")),
    }
    site.start()
    yield site
    site.stop()


def frontier_entry(tenant: str, job: str, url: str, **fields: object) -> FrontierEntry:
    canonical = canonical_url(url)
    return FrontierEntry(tenant=tenant, job_id=job, url=canonical,
                         fingerprint=fingerprint(canonical), host=host_of(canonical), depth=0,
                         **fields)


async def publish(js: JetStreamContext, entry: FrontierEntry) -> None:
    subject = subjects.frontier(subjects.partition_of(entry.host), entry.tenant, entry.job_id)
    msg_id = subjects.msg_id(Stage.DEDUP, entry.tenant, entry.job_id, entry.fingerprint,
                             entry.generation)
    await js.publish(subject, encode(entry), headers={"Nats-Msg-Id": msg_id})


async def stream_messages(js: JetStreamContext, stream: str) -> list[bytes]:
    state = (await js.stream_info(stream)).state
    found = []
    for seq in range(state.first_seq, state.last_seq + 1):
        with contextlib.suppress(NotFoundError):
            found.append((await js.get_msg(stream, seq)).data or b"")
    return found


async def wait_for_count(js: JetStreamContext, stream: str, count: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while (await js.stream_info(stream)).state.messages < count:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {count} messages on {stream}")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def fetcher(nc: Client, settings: MeshSettings, tenant: str, job: str):
    """The fetcher service as ``crawlmesh service fetcher`` runs it (its partition leases,
    :func:`services.fetcher.main.run_partitions`), in a task, for a running job (the
    fetcher drops entries of jobs that are not running); yields its handler."""
    await JobStore(nc.jetstream()).create(
        JobRecord(tenant=tenant, job_id=job, request=CrawlRequest(seeds=("http://127.0.0.1/",))))
    built: list[fetcher_main.RunningJobsOnly] = []
    ready = asyncio.Event()
    build = fetcher_main.build_handler

    def capture(*args: object, **kwargs: object) -> fetcher_main.RunningJobsOnly:
        guarded = build(*args, **kwargs)  # type: ignore[arg-type]
        built.append(guarded)
        ready.set()
        return guarded

    stop = asyncio.Event()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fetcher_main, "build_handler", capture)
        task = asyncio.create_task(fetcher_main.run_partitions(nc, settings, stop))
        await asyncio.wait_for(ready.wait(), 10)
    try:
        assert isinstance(built[0].handler, FetcherHandler)
        yield built[0].handler
    finally:
        stop.set()
        await asyncio.wait_for(task, settings.shutdown_grace_s + 10)


async def test_fetcher_service_fetches_stores_and_refuses(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    site: Site, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CRAWLMESH_FETCHER_EGRESS_ALLOW", '["127.0.0.0/8"]')
    monkeypatch.setenv("CRAWLMESH_FETCHER_HOST_DELAYS", '{"127.0.0.*": 0}')
    mesh = settings.model_copy(update={"body_inline_max_bytes": 4096})
    home, big, private = (frontier_entry(tenant, job, site.url(p)) for p in ("/", "/big", "/private"))
    async with fetcher(nc, mesh, tenant, job):
        for entry in (home, big, private):
            await publish(js, entry)
        await wait_for_count(js, streams.FETCHED.name, 3)

    pages = {p.url: p for p in (decode(d, FetchedPage) for d in
                                await stream_messages(js, streams.FETCHED.name))}
    assert pages[home.url].status == 200
    assert b"home" in decompress(pages[home.url].body, pages[home.url].body_encoding)
    assert pages[private.url].error == f"{ROBOTS_DISALLOWS} {private.url}"
    assert "/private" not in site.requests
    assert site.requests.count("/robots.txt") == 1

    ref = pages[big.url].body_ref
    assert ref is not None and ref.bucket == streams.bodies_bucket(tenant)
    stored = await (await js.object_store(ref.bucket)).get(ref.name)
    assert decompress(stored.data or b"", "zlib") == site.pages["/big"][2]

    kv = await js.key_value(streams.ROBOTS_BUCKET)
    record = await kv.get(store_key(origin_of(site.base)))
    assert RobotsRules.from_bytes(record.value or b"").verdict is RobotsVerdict.RULES


async def test_loopback_refused_by_default(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str, site: Site,
) -> None:
    entry = frontier_entry(tenant, job, site.url("/"))
    async with fetcher(nc, settings, tenant, job):
        await publish(js, entry)
        await wait_for_count(js, streams.FETCHED.name, 1)
    (data,) = await stream_messages(js, streams.FETCHED.name)
    assert decode(data, FetchedPage).error == f"egress policy refuses 127.0.0.1 for {entry.url}"
    assert site.requests == []


async def test_busy_host_entry_waits_for_the_host(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    site: Site, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CRAWLMESH_FETCHER_EGRESS_ALLOW", '["127.0.0.0/8"]')
    monkeypatch.setenv("CRAWLMESH_FETCHER_QUEUE_HORIZON_S", "0.5")
    monkeypatch.setenv("CRAWLMESH_FETCHER_DEFAULT_DELAY_S", "0")
    entry = frontier_entry(tenant, job, site.url("/"))
    async with fetcher(nc, settings, tenant, job) as handler:
        assert isinstance(handler, FetcherHandler)
        handler.politeness.pause(entry.host, 1.5)  # the host is busy for 1.5 s
        started = utc_now()
        await publish(js, entry)
        await wait_for_count(js, streams.FETCHED.name, 1)
    (data,) = await stream_messages(js, streams.FETCHED.name)
    page = decode(data, FetchedPage)
    assert page.status == 200 and page.fetched_at - started >= timedelta(seconds=1.4)
    # (whether it waited in process or was re-published under a new generation is the
    # politeness rules' choice, tested with them)


async def test_a_suspended_tenant_is_held_then_republished_without_fetching(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
) -> None:
    """Entries of a suspended tenant are not fetched: held, then re-published under the
    next generation (never nak'd, which would count towards max_deliver); once resumed
    they are fetched."""
    from shared.accounts.control import TenantControl
    from shared.bus.loop import Delivery
    from shared.tenantgate import TenantGate

    class NoFetch:
        calls = 0

        async def handle(self, message: FrontierEntry, delivery: Delivery) -> list[object]:
            NoFetch.calls += 1
            return []

    await JobStore(js).create(JobRecord(tenant=tenant, job_id=job,
                                        request=CrawlRequest(seeds=("http://127.0.0.1/",))))
    async with TenantControl.open(settings) as control:
        await control.suspend("test")
    guard = fetcher_main.RunningJobsOnly(NoFetch(), JobStore(js),  # type: ignore[arg-type]
                                         TenantGate(js, ttl_s=0.1), hold_s=0.3)
    entry = frontier_entry(tenant, job, "http://127.0.0.1/x", generation=2)
    delivery = Delivery(subject="s", headers={}, delivered=1, stream_seq=1, tenant=tenant,
                        job=job)
    (held,) = await guard.handle(entry, delivery)
    assert NoFetch.calls == 0
    assert held.message == entry.model_copy(update={"generation": 3})
    assert held.subject == subjects.frontier(subjects.partition_of(entry.host), tenant, job)
    assert held.msg_id.endswith(":3")

    async with TenantControl.open(settings) as control:
        await control.resume("test")
    assert await guard.handle(entry, delivery) == []
    assert NoFetch.calls == 1


async def test_cross_host_redirect_goes_to_links_not_followed(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    site: Site, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A redirect to another host comes back as a ``redirect`` links message for dedup (so
    the target's robots.txt and budget apply) and the page's result; the target is not
    requested by the fetcher."""
    monkeypatch.setenv("CRAWLMESH_FETCHER_EGRESS_ALLOW", '["127.0.0.0/8"]')
    monkeypatch.setenv("CRAWLMESH_FETCHER_HOST_DELAYS", '{"127.0.0.*": 0}')
    other = Site().start()
    try:
        site.routes["/moved"] = lambda req: (req.send_response(301),
                                             req.send_header("Location", other.url("/new")),
                                             req.send_header("Content-Length", "0"),
                                             req.end_headers())
        entry = frontier_entry(tenant, job, site.url("/moved"))
        async with fetcher(nc, settings, tenant, job):
            await publish(js, entry)
            await wait_for_count(js, streams.LINKS.name, 1)
            await wait_for_count(js, streams.PARSED.name, 1)
        (links_data,) = await stream_messages(js, streams.LINKS.name)
        links = decode(links_data, DiscoveredLinks)
        assert links.origin is LinkOrigin.REDIRECT and links.source_fingerprint == entry.fingerprint
        assert [link.url for link in links.links] == [other.url("/new")]
        (parsed_data,) = await stream_messages(js, streams.PARSED.name)
        page = decode(parsed_data, ParsedPage)
        assert (page.status, page.final_url, page.error) == (301, other.url("/new"), None)
        assert other.requests == []
        assert (await js.stream_info(streams.FETCHED.name)).state.messages == 0
    finally:
        other.stop()
