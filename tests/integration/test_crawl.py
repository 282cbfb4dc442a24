"""End to end: the five service processes crawl a real loopback site to completion.

The site has links, a relative <base>, a redirect, a 404, a robots.txt Disallow, a page
that returns 500 every time, a page whose handling always crashes (fault injection in the
parser), non-HTML content, and a page that takes 3 s.
"""

from __future__ import annotations

import asyncio
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import orjson
import pytest

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.jobs import export_results, read_events, submit, wait_for_job
from shared.contracts import CrawlRequest, JobEventKind
from shared.tenancy import DEFAULT_TENANT
from tests.integration.meshproc import MeshProcess
from tests.sites import Site, html, ring_site, wait_for

pytestmark = pytest.mark.timeout(180)


def slow(handler: BaseHTTPRequestHandler) -> None:
    time.sleep(3)
    body = html("slow but fine", "Slow")
    handler.send_response(200)
    handler.send_header("Content-Type", "text/html")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def redirect(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(302)
    handler.send_header("Location", "/c")
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def build_site() -> Site:
    links = "".join(f'<a href="{p}">{p}</a> ' for p in (
        "/a", "/b", "/redirect", "/missing", "/private", "/error", "/crash", "/file.pdf",
        "/slow", "/base/index.html", "mailto:someone@example.org", "#top",
    ))
    site = Site()
    site.pages = {
        "/robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /private\n"),
        "/": (200, "text/html; charset=utf-8", html(links, "Home")),
        "/a": (200, "text/html", html('<a href="/">home</a> <a href="/b">b</a>', "A")),
        "/b": (200, "text/html", html("leaf", "B")),
        "/c": (200, "text/html", html("redirect target", "C")),
        "/private": (200, "text/html", html("secret", "Private")),
        "/error": (500, "text/html", html("boom", "Error")),
        "/crash": (200, "text/html", html("CRASH-ME", "Crash")),
        "/file.pdf": (200, "application/pdf", b"%PDF-1.4 not really"),
        "/base/index.html": (200, "text/html",
                             html('<base href="../sub/"><a href="d">d</a>', "Base")),
        "/sub/d": (200, "text/html", html("via base", "D")),
    }
    site.routes = {"/slow": slow, "/redirect": redirect}
    return site.start()


async def crawl(mesh: MeshProcess, seed: str, out: Path, **limits: int) -> tuple[str, dict]:
    """Submit as the default tenant (its creds file), wait, export; the job's events too."""
    creds = KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT)
    tnc = await connect(mesh.settings, "test-client", creds=creds)
    try:
        job = await submit(tnc, CrawlRequest(seeds=(seed,), **limits))
        event = await wait_for_job(tnc, job, show=False)
        await export_results(tnc, job, out)
        events = [e.model_dump(mode="json") for e in await read_events(tnc.jetstream(), job)]
        return job, {"final": event, "events": events}
    finally:
        await tnc.close()


def read_results(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def test_crawl_of_a_site_with_every_kind_of_page(tmp_path: Path) -> None:
    site = build_site()
    mesh = MeshProcess(tmp_path / "home",
                       env={"CRAWLMESH_FAULT_INJECT": "parser:/crash\""}).start()
    try:
        out = tmp_path / "results.jsonl"
        started = time.time()
        _job, info = asyncio.run(crawl(mesh, site.url("/"), out))
        results = read_results(out)
    finally:
        assert mesh.stop() == 0
        site.stop()

    by_url = {r["url"].removeprefix(site.base): r for r in results}
    assert len(by_url) == len(results), "a URL appears twice"
    assert set(by_url) == {"/", "/a", "/b", "/redirect", "/missing", "/private", "/error",
                           "/crash", "/file.pdf", "/slow", "/base/index.html", "/sub/d"}
    assert by_url["/"]["outcome"] == "ok" and by_url["/"]["title"] == "Home"
    assert by_url["/redirect"]["final_url"] == site.url("/c")
    assert by_url["/missing"]["outcome"] == "http_error" and by_url["/missing"]["status"] == 404
    assert by_url["/private"]["outcome"] == "robots_disallowed"
    assert "/private" not in site.requests
    assert by_url["/error"]["status"] == 500 and by_url["/error"]["outcome"] == "http_error"
    assert site.requests.count("/error") == 3  # first try + 2 retries
    assert by_url["/crash"]["outcome"] == "failed"
    assert "injected fault" in by_url["/crash"]["error"]
    assert by_url["/file.pdf"]["outcome"] == "unsupported"
    assert by_url["/sub/d"]["title"] == "D"
    assert by_url["/slow"]["title"] == "Slow"

    final = info["final"]
    assert final.kind is JobEventKind.COMPLETED
    assert final.counters.admitted == final.counters.finished == 12
    assert final.counters.failed == 1
    kinds = [e["kind"] for e in info["events"]]
    assert kinds.count("completed") == 1 and kinds[0] == "started"
    assert final.at.timestamp() >= started + 3


def test_crawl_survives_sigkill_of_dedup_and_sink(tmp_path: Path) -> None:
    pages = 150
    site = ring_site(pages, fanout=5)
    # A small per-host delay keeps the crawl running while processes are killed.
    mesh = MeshProcess(tmp_path / "home",
                       env={"CRAWLMESH_FETCHER_HOST_DELAYS": '{"127.0.0.*": 0.02}'}).start()
    killed: list[int] = []

    async def run() -> tuple[str, dict]:
        task = asyncio.create_task(crawl(mesh, site.url("/p0"), tmp_path / "r.jsonl",
                                         max_depth=100))
        # Kill dedup and sink mid-crawl, twice each, once a few pages are fetched.
        for _ in range(2):
            target = 20 + 40 * len(killed) // 2
            await asyncio.to_thread(wait_for, lambda t=target: len(site.requests) >= t or task.done(),
                                    60, f"{target} requests")
            assert not task.done(), "the crawl finished before the kills"
            killed.append(await asyncio.to_thread(mesh.kill_service, "dedup"))
            killed.append(await asyncio.to_thread(mesh.kill_service, "sink"))
        return await task

    try:
        _job, info = asyncio.run(run())
        results = read_results(tmp_path / "r.jsonl")
    finally:
        assert mesh.stop() == 0
        site.stop()
    urls = [r["url"] for r in results]
    assert len(killed) == 4
    assert len(urls) == len(set(urls)), "duplicate results"
    assert set(urls) == {site.url(f"/p{i}") for i in range(pages)}
    assert [e["kind"] for e in info["events"]].count("completed") == 1
    assert info["final"].counters.finished == pages
