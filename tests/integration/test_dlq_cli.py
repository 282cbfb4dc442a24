"""``crawlmesh dlq list|show|replay|purge`` against a real embedded mesh and real dead letters.

A crawl runs with a fault injected in the fetcher for ``/crash`` (every delivery fails, so
the page is dead-lettered and finished as ``failed``); a payload that is not JSON is
published on the job's links subject (dead-lettered by dedup at once). Then the mesh is
restarted without the fault ("the bug is fixed") and the dead letters are listed, shown,
replayed and purged, checking what the tenant receives: the completed job's results get one
more record for ``/crash``, marked as a replay, once; its counters and events do not change;
the replayed page's outlinks are not followed. Links that came before their job (dead:
unknown job) are refused while the job does not exist and, once it runs, replayed into
dedup like any links: their page is crawled as part of the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from shared import subjects
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.bus.dlqstore import Selection, read_letters
from shared.bus.loop import Delivery
from shared.bus.replays import REPLAY_HEADER, REPLAY_OF_HEADER, Replay
from shared.cli.jobs import export_results, read_events, submit
from shared.codec import encode
from shared.contracts import (
    CrawlRequest,
    DeadLetter,
    DiscoveredLinks,
    JobEvent,
    JobEventKind,
    JobState,
    Link,
    LinkOrigin,
    Outcome,
    PageResult,
    ParsedPage,
)
from shared.jobs import ledger_counts
from shared.settings import MeshSettings
from shared.streams import DLQ, EXPANDED, FETCHED, FRONTIER, LINKS, PARSED, SINK_DLQ
from shared.subjects import Stage
from shared.tenancy import DEFAULT_TENANT, TenantRegistry
from tests.conftest import tenant_js
from tests.integration.meshproc import MeshProcess
from tests.integration.test_sink import SITE, Crawl, Sink, delivery, fp, sink
from tests.sites import Site, html, wait_for

pytestmark = pytest.mark.timeout(400)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
WORK_STREAMS = (LINKS.name, FRONTIER.name, FETCHED.name, PARSED.name, EXPANDED.name)


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def crawlmesh(mesh: MeshProcess, *args: str, timeout_s: float = 60) -> Run:
    """Run the real ``crawlmesh`` command with the mesh's environment (stdin: not a TTY)."""
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", *args], cwd=REPO_ROOT,
        env={**mesh.env, "COLUMNS": "200"}, capture_output=True, timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    return Run(done.returncode, done.stdout.decode(), done.stderr.decode())


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def results_of(mesh: MeshProcess, job: str) -> list[dict]:
    """The job's results in the tenant's RESULTS (read as the tenant)."""

    async def read() -> list[dict]:
        creds = KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT)
        tnc = await connect(mesh.settings, "test-dlq-tenant", creds=creds, persistent=False)
        try:
            out = mesh.home / "results.jsonl"
            await export_results(tnc, job, out)
            return json_lines(out.read_text())
        finally:
            await tnc.close()

    return asyncio.run(read())


def recorded_letters(mesh: MeshProcess) -> int:
    """How many dead letters the DLQ holds, if the sink has recorded all of them (else -1)."""

    async def count() -> int:
        nc = await connect(mesh.settings, "test-dlq", persistent=False)
        try:
            found = await read_letters(nc.jetstream(), Selection())
            return len(found) if all(s.recorded for s in found) else -1
        finally:
            await nc.close()

    return asyncio.run(count())


def build_site(release: threading.Event) -> Site:
    """``/hold`` answers once ``release`` is set (its job stays running until then)."""

    def hold(handler: BaseHTTPRequestHandler) -> None:
        release.wait(60)
        body = html("held", "Held")
        handler.send_response(200)
        handler.send_header("Content-Type", "text/html")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    site = Site()
    site.routes = {"/hold": hold}
    site.pages = {
        "/robots.txt": (404, "text/plain", b""),
        "/": (200, "text/html", html('<a href="/a">a</a> <a href="/crash">crash</a>', "Home")),
        "/a": (200, "text/html", html("leaf", "A")),
        "/crash": (200, "text/html", html('<a href="/from-crash">only here</a>', "Crash")),
        "/from-crash": (200, "text/html", html("never admitted", "Orphan")),
        "/extra": (200, "text/html", html("admitted by a replay", "Extra")),
    }
    return site.start()


async def mesh_state(mesh: MeshProcess) -> tuple[str, dict[str, int]]:
    """The default tenant's id and the message count of each work-queue stage stream."""
    nc = await connect(mesh.settings, "test-dlq", persistent=False)
    try:
        js = nc.jetstream()
        tenant = await TenantRegistry(js).resolve(DEFAULT_TENANT)
        counts = {name: (await js.stream_info(name)).state.messages for name in WORK_STREAMS}
        return tenant, counts
    finally:
        await nc.close()


async def publish(mesh: MeshProcess, subject: str, payload: bytes,
                  headers: dict[str, str] | None = None) -> None:
    nc = await connect(mesh.settings, "test-dlq", persistent=False)
    try:
        await nc.jetstream().publish(subject, payload, headers=headers)
    finally:
        await nc.close()


async def events_of(mesh: MeshProcess, job: str) -> list[JobEvent]:
    """The job's events in the tenant's EVENTS (read as the tenant)."""
    creds = KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT)
    tnc = await connect(mesh.settings, "test-dlq-tenant", creds=creds, persistent=False)
    try:
        return await read_events(tnc.jetstream(), job)
    finally:
        await tnc.close()


async def submit_as_tenant(mesh: MeshProcess, request: CrawlRequest) -> str:
    creds = KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT)
    tnc = await connect(mesh.settings, "test-dlq-tenant", creds=creds, persistent=False)
    try:
        return await submit(tnc, request)
    finally:
        await tnc.close()


def settled(mesh: MeshProcess) -> bool:
    """Nothing left in any work-queue stage stream (every message acked or terminated)."""
    return not any(asyncio.run(mesh_state(mesh))[1].values())


def listed(mesh: MeshProcess, *filters: str) -> list[dict]:
    run = crawlmesh(mesh, "dlq", "list", "--json", *filters)
    assert run.returncode == 0, run.stderr
    return json_lines(run.stdout)


def test_dead_letters_listed_shown_replayed_and_purged(tmp_path: Path) -> None:
    release = threading.Event()
    site = build_site(release)
    home = tmp_path / "home"
    mesh = MeshProcess(home, env={"CRAWLMESH_FAULT_INJECT": 'fetcher:/crash"'}).start()
    try:
        run = crawlmesh(mesh, "crawl", "--wait", site.url("/"), timeout_s=120)
        assert run.returncode == 0, run.stderr
        job = run.stdout.split()[-1]
        tenant, _ = asyncio.run(mesh_state(mesh))
        asyncio.run(publish(mesh, subjects.links(tenant, job), b"not json"))
        wait_for(lambda: recorded_letters(mesh) == 2, 30, "two dead letters recorded by the sink")
        before = results_of(mesh, job)
        status_before = json.loads(crawlmesh(mesh, "status", job).stdout)
    finally:
        assert mesh.stop() == 0, mesh.log("launcher")
    assert "/crash" not in site.requests  # the fetcher died on it every time
    assert sorted(r["url"].removeprefix(site.base) for r in before) == ["/", "/a", "/crash"]
    failed = next(r for r in before if r["url"].endswith("/crash"))
    assert failed["outcome"] == "failed" and "injected fault" in failed["error"]
    assert status_before["state"] == "completed" and status_before["failed"] == 1

    mesh = MeshProcess(home).start()  # the fault is gone: a fixed deployment
    try:
        # list: one line per dead letter, filters combine
        run = crawlmesh(mesh, "dlq", "list")
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert len(lines) == 2 and "2 dead letters" in run.stderr
        assert lines[0].startswith("FRONTIER:") and "stage=fetcher" in lines[0]
        assert f"tenant={DEFAULT_TENANT} job={job} deliveries=3" in lines[0]
        assert "injected fault" in lines[0]
        assert lines[1].startswith("LINKS:") and "stage=dedup" in lines[1]
        (page,) = listed(mesh, "--stage", "fetcher")
        (links,) = listed(mesh, "--stage", "dedup", "--tenant", DEFAULT_TENANT, "--job", job)
        assert page["tenant"] == tenant and page["tenant_name"] == DEFAULT_TENANT
        assert page["job_id"] == job and page["delivery_count"] == 3
        assert links["reason"].startswith("invalid JSON") and links["delivery_count"] == 1
        assert listed(mesh, "--stage", "fetcher", "--job", "-") == []
        run = crawlmesh(mesh, "dlq", "list", "--tenant", "nosuch")
        assert run.returncode == 1 and "unknown tenant 'nosuch'" in run.stderr

        # show: the whole dead letter, the original decoded
        run = crawlmesh(mesh, "dlq", "show", page["id"])
        assert run.returncode == 0, run.stderr
        shown = json.loads(run.stdout)
        assert shown["original_encoding"] == "json"
        assert shown["original"]["url"] == site.url("/crash")
        assert shown["headers"]["Nats-Msg-Id"].startswith(f"dedup:{tenant}:{job}:")
        assert "injected fault" in shown["reason"] and shown["subject"].startswith("mesh.frontier.")
        run = crawlmesh(mesh, "dlq", "show", "FRONTIER:999999")
        assert run.returncode == 1 and "no dead letter FRONTIER:999999" in run.stderr

        # replay --dry-run: says what it would do, does nothing
        run = crawlmesh(mesh, "dlq", "replay", "--dry-run")
        assert run.returncode == 1  # the links of a completed job are refused
        assert f"would replay {page['id']} to {page['subject']} as " in run.stdout
        assert f"refused {links['id']}: job {job} is completed: dedup admits links only" \
            in run.stdout
        assert len(listed(mesh)) == 2 and "/crash" not in site.requests

        # replay the page: one more result for /crash, marked; nothing else changes
        run = crawlmesh(mesh, "dlq", "replay", "--id", page["id"])
        assert run.returncode == 0, run.stderr
        assert run.stdout.startswith(f"replayed {page['id']} to {page['subject']} as ")
        assert f":replay{page['dlq_seq']} (FRONTIER seq " in run.stdout
        wait_for(lambda: len(results_of(mesh, job)) == 4, 60, "the replayed page's result")
        wait_for(lambda: settled(mesh), 30, "the mesh to settle")
        # a redelivery of the replayed message (same replay generation) adds nothing
        original = json.dumps(shown["original"]).encode()
        asyncio.run(publish(mesh, page["subject"], original, {
            "Nats-Msg-Id": f"redelivered-{page['id']}", REPLAY_HEADER: str(page["dlq_seq"]),
            REPLAY_OF_HEADER: page["id"]}))
        wait_for(lambda: site.requests.count("/crash") == 2, 30, "the second fetch")
        wait_for(lambda: settled(mesh), 30, "the mesh to settle")
        after = results_of(mesh, job)
        assert len(after) == 4 and after[:3] == before
        replayed = after[3]
        assert replayed["url"] == site.url("/crash") and replayed["outcome"] == "ok"
        assert replayed["title"] == "Crash" and replayed["replay_of"] == page["id"]
        assert "/from-crash" not in site.requests  # a replayed page's links are not followed
        status_after = json.loads(crawlmesh(mesh, "status", job).stdout)
        assert status_after == status_before
        kinds = [e.kind for e in asyncio.run(events_of(mesh, job))]
        assert kinds.count(JobEventKind.COMPLETED) == 1, kinds
        assert [d["id"] for d in listed(mesh)] == [links["id"]]  # deleted once acked

        # links replay into dedup as usual, for a running job: these came before their job
        job2 = subjects.new_job_id()
        early = DiscoveredLinks(tenant=tenant, job_id=job2, origin=LinkOrigin.OUTLINKS,
                                depth=1, source_url=site.url("/hold"), source_fingerprint="0" * 32,
                                links=(Link(url=site.url("/extra")),))
        asyncio.run(publish(mesh, subjects.links(tenant, job2), encode(early)))
        wait_for(lambda: recorded_letters(mesh) == 2, 30, "the early links dead-lettered")
        (dead_links,) = listed(mesh, "--job", job2)
        assert dead_links["reason"] == f"unknown job {job2!r} of tenant {tenant}"
        run = crawlmesh(mesh, "dlq", "replay", "--job", job2)
        assert run.returncode == 1
        assert run.stdout == f"refused {dead_links['id']}: job {job2} does not exist (any more)\n"
        asyncio.run(submit_as_tenant(mesh, CrawlRequest(seeds=(site.url("/hold"),), job_id=job2)))
        run = crawlmesh(mesh, "dlq", "replay", "--job", job2)
        assert run.returncode == 0 and run.stdout.startswith(f"replayed {dead_links['id']} ")
        wait_for(lambda: "/extra" in site.requests, 30, "the replayed link fetched")
        release.set()
        wait_for(lambda: any(e.kind is JobEventKind.COMPLETED
                             for e in asyncio.run(events_of(mesh, job2))), 30, "job 2 completed")
        second = results_of(mesh, job2)
        assert sorted(r["url"].removeprefix(site.base) for r in second) == ["/extra", "/hold"]
        assert all(r["replay_of"] is None for r in second)
        status2 = json.loads(crawlmesh(mesh, "status", job2).stdout)
        assert (status2["admitted"], status2["finished"], status2["failed"]) == (2, 2, 0)

        # purge: never without confirmation; --yes deletes
        run = crawlmesh(mesh, "dlq", "purge", "--stage", "dedup")
        assert run.returncode == 1 and "without --yes" in run.stderr
        assert len(listed(mesh)) == 1
        run = crawlmesh(mesh, "dlq", "purge", "--stage", "dedup", "--yes")
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == f"purged {links['id']}"
        assert listed(mesh) == []
    finally:
        release.set()
        assert mesh.stop() == 0, mesh.log("launcher")
        site.stop()


# ---- the sink's side of a page replay, with its real handlers (real NATS, tenant account) ----


@pytest.fixture
async def tjs(settings: MeshSettings, tenant: str) -> AsyncIterator[JetStreamContext]:
    """JetStream inside the tenant's own account."""
    async with tenant_js(settings, "test") as tjs_:
        yield tjs_


@pytest.fixture
async def crawl(js: JetStreamContext, tenant: str, job: str, tjs: JetStreamContext) -> Crawl:
    job_crawl = Crawl(js, tenant, job, tjs)
    await job_crawl.start()
    return job_crawl


@pytest.fixture
async def handlers(nc: Client, settings: MeshSettings) -> Sink:
    return await sink(nc, settings)


def dead_page(crawl: Crawl, path: str, headers: dict[str, str] | None = None) -> DeadLetter:
    page = ParsedPage(tenant=crawl.tenant, job_id=crawl.job, url=SITE + path,
                      final_url=SITE + path, fingerprint=fp(path), depth=0, status=200,
                      content_type="text/html", fetched_at=datetime.now(UTC))
    return DeadLetter(id="PARSED:7", tenant=crawl.tenant, job_id=crawl.job, stage="sink",
                      reason="RuntimeError: boom", delivery_count=3,
                      subject=subjects.parsed(crawl.tenant, crawl.job), stream="PARSED",
                      stream_seq=7, headers=headers or {}, original=encode(page))


def replayed(crawl: Crawl, generation: int, of: str, delivered: int = 1) -> Delivery:
    return Delivery(subject=subjects.parsed(crawl.tenant, crawl.job),
                    headers=Replay(generation, of).headers(), delivered=delivered,
                    stream_seq=100 + generation, tenant=crawl.tenant, job=crawl.job)


async def test_a_page_replay_of_a_completed_job_is_one_more_result_once_per_replay(
    crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    await crawl.expanded(handlers, await crawl.admit(None, "/"))
    letter = dead_page(crawl, "/")
    await handlers.dead_letters.handle(letter, delivery(
        subjects.dlq(Stage.SINK, crawl.tenant, crawl.job), crawl.tenant, crawl.job))
    (completed,) = await crawl.completions(settings)
    assert (await crawl.record()).state is JobState.COMPLETED
    counts = await ledger_counts(crawl.js, crawl.tenant, crawl.job)

    page = crawl.parsed("/", depth=0)
    for delivered in (1, 2, 3):  # the replayed message, redelivered
        await handlers.results.handle(page, replayed(crawl, 42, letter.id, delivered))
    results = await crawl.results(settings)
    assert [(r.outcome, r.replay_of) for r in results] == [
        (Outcome.FAILED, None), (Outcome.OK, "PARSED:7")]
    assert results[1].title == "title of /"
    await handlers.results.handle(page, replayed(crawl, 43, "PARSED:9"))  # another replay
    assert [r.replay_of for r in await crawl.results(settings)] == [None, "PARSED:7", "PARSED:9"]
    assert await crawl.completions(settings) == [completed]
    assert await ledger_counts(crawl.js, crawl.tenant, crawl.job) == counts
    assert (await crawl.record()).counters == completed.counters


async def test_a_page_replay_that_dies_again_fails_nothing_more(
    crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    await crawl.expanded(handlers, await crawl.admit(None, "/", "/b"))
    dlq = delivery(subjects.dlq(Stage.SINK, crawl.tenant, crawl.job), crawl.tenant, crawl.job)
    await handlers.dead_letters.handle(dead_page(crawl, "/"), dlq)
    again = dead_page(crawl, "/", Replay(12, "PARSED:7").headers())
    await handlers.dead_letters.handle(again.model_copy(update={"id": "PARSED:30"}), dlq)
    assert [r.outcome for r in await crawl.results(settings)] == [Outcome.FAILED]
    counts = await ledger_counts(crawl.js, crawl.tenant, crawl.job)
    assert (counts.admitted, counts.finished, counts.failed) == (2, 1, 1)
    await crawl.result(handlers, "/b")
    await crawl.expanded(handlers, await crawl.admit("/b"))
    (completed,) = await crawl.completions(settings)
    assert completed.counters.finished == 2 and completed.counters.failed == 1


async def test_a_page_replay_of_a_cancelled_job_is_dropped(
    js: JetStreamContext, tenant: str, handlers: Sink, settings: MeshSettings,
    tjs: JetStreamContext,
) -> None:
    cancelled = Crawl(js, tenant, subjects.new_job_id(), tjs)
    await cancelled.start(JobState.CANCELLED)
    await handlers.results.handle(cancelled.parsed("/"), replayed(cancelled, 5, "PARSED:1"))
    assert await cancelled.results(settings) == []


async def test_a_dead_letter_the_sink_gave_up_on_does_not_hold_back_later_ones(
    js: JetStreamContext, nc: Client, tenant: str, job: str,
) -> None:
    """nats-server leaves ``sink-dlq``'s ack floor behind a message that exhausted its
    deliveries; once nothing is in flight, every delivered dead letter counts as recorded."""
    crawl = Crawl(js, tenant, job, js)
    for seq in (1, 2):
        letter = dead_page(crawl, f"/p{seq}").model_copy(update={"id": f"PARSED:{seq}"})
        await js.publish(subjects.dlq(Stage.SINK, tenant, job), encode(letter))
    assert [s.recorded for s in await read_letters(js, Selection())] == [False, False]
    sub = await js.pull_subscribe_bind(SINK_DLQ.durable, DLQ.name)
    try:
        first, second = await sub.fetch(2, timeout=5)
        await second.ack()
        assert [s.recorded for s in await read_letters(js, Selection())] == [False, False]

        async def given_up() -> bool:  # redelivered until max_deliver (3, 1 s apart)
            with contextlib.suppress(NatsTimeoutError, TimeoutError):
                for msg in await sub.fetch(1, timeout=0.5):
                    assert msg.data == first.data
            info = await js.consumer_info(DLQ.name, SINK_DLQ.durable)
            return not info.num_ack_pending and not info.num_pending

        deadline = asyncio.get_running_loop().time() + 15
        while not await given_up():
            assert asyncio.get_running_loop().time() < deadline, "still redelivered"
        assert [s.recorded for s in await read_letters(js, Selection())] == [True, True]
    finally:
        await sub.unsubscribe()


async def test_a_dead_parked_result_fails_its_page_and_its_replay_is_one_more_result(
    nc: Client, crawl: Crawl, handlers: Sink, settings: MeshSettings,
) -> None:
    """A parked result that could not be stored (dead-lettered from ``PARKED``) finishes its
    page as failed, so the job completes instead of waiting for it forever; replaying it
    stores the result once, marked ``replay_of``."""
    from services.sink.main import setup as sink_setup
    from shared.bus.service import TenantLoops

    await crawl.expanded(handlers, await crawl.admit(None, "/"))
    parked = PageResult(tenant=crawl.tenant, job_id=crawl.job, url=SITE + "/",
                        fingerprint=fp("/"), outcome=Outcome.OK, status=200, depth=0,
                        title="title of /")
    letter = DeadLetter(id="PARKED:3", tenant=crawl.tenant, job_id=crawl.job, stage="sink",
                        reason="RuntimeError: boom", delivery_count=1,
                        subject=subjects.parked(crawl.tenant, crawl.job), stream="PARKED",
                        stream_seq=3, headers={}, original=encode(parked))
    await handlers.dead_letters.handle(letter, delivery(
        subjects.dlq(Stage.SINK, crawl.tenant, crawl.job), crawl.tenant, crawl.job))
    (completed,) = await crawl.completions(settings)
    assert completed.counters.finished == 1 and completed.counters.failed == 1
    (failed,) = await crawl.results(settings)
    assert failed.outcome is Outcome.FAILED and "dead-lettered by sink" in (failed.error or "")

    (parked_loops,) = [spec for spec in await sink_setup(nc, settings)
                       if isinstance(spec, TenantLoops) and spec.name == "sink-parked"]
    handler = parked_loops.factory(crawl.tenant).handler
    for delivered in (1, 2):  # the replayed message, redelivered
        await handler.handle(parked, Delivery(
            subject=subjects.parked(crawl.tenant, crawl.job),
            headers=Replay(9, letter.id).headers(), delivered=delivered, stream_seq=20,
            tenant=crawl.tenant, job=crawl.job))
    results = await crawl.results(settings)
    assert [(r.outcome, r.replay_of) for r in results] == [
        (Outcome.FAILED, None), (Outcome.OK, "PARKED:3")]
    assert await crawl.completions(settings) == [completed]
