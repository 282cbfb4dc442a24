"""Politeness that holds across every fetcher and tenant (issue 5), judged by the servers.

``crawlmesh up`` with 3 fetcher processes (leases of 1 s) crawls loopback sites whose
servers log every request with its start and end time (:class:`LoggedSite`):

- a *shared* host crawled by two tenants' jobs at once (rule: 0.2 s, 2 in flight);
- a host whose robots.txt says ``Crawl-delay: 2`` and disallows ``/private``;
- a host answering 429 with ``Retry-After: 3`` (once per page, then 200);
- a slow host (0.4 s per answer; 1 in flight).

One fetcher is SIGKILLed mid-crawl: its partitions are taken over by the others (the
``leases`` bucket shows no partition held by it within a few lease periods) and both jobs
complete. From each server's own log: the least gap between two request starts is never
below the delay in force (tolerance 50 ms), requests in flight never exceed the limit,
disallowed URLs are never requested, and no request starts during a Retry-After pause.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest
from nats.js.errors import KeyNotFoundError

from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.jobs import export_results, submit, wait_for_job
from shared.contracts import CrawlRequest, JobEventKind
from shared.streams import LEASES_BUCKET
from shared.tenancy import DEFAULT_TENANT
from tests.integration.meshproc import MeshProcess
from tests.sites import html, wait_for

pytestmark = pytest.mark.timeout(240)

TOLERANCE_S = 0.05
LEASE_S = 1.0


@dataclass(frozen=True)
class Hit:
    path: str
    start: float  # time.monotonic() when the request line was read
    end: float  # after the last byte was written


@dataclass
class LoggedSite:
    """A threaded loopback server that logs (path, start, end) of every request."""

    host: str
    pages: dict[str, bytes] = field(default_factory=dict)
    robots: bytes = b"User-agent: *\nDisallow:\n"
    answer_s: float = 0.01
    retry_after: dict[str, int] = field(default_factory=dict)  # path -> seconds (once)
    hits: list[Hit] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def base(self) -> str:
        assert self.server is not None
        return f"http://{self.host}:{self.server.server_address[1]}"

    @property
    def hostport(self) -> str:
        return self.base.removeprefix("http://")

    def start(self) -> LoggedSite:
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                started = time.monotonic()
                status, body, headers = site.answer(self.path)
                if self.path != "/robots.txt":
                    time.sleep(site.answer_s)
                self.send_response(status)
                self.send_header("Content-Type",
                                 "text/plain" if self.path == "/robots.txt" else "text/html")
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                with site._lock:
                    site.hits.append(Hit(self.path, started, time.monotonic()))

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((self.host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def answer(self, path: str) -> tuple[int, bytes, dict[str, str]]:
        if path == "/robots.txt":
            return 200, self.robots, {}
        with self._lock:
            pause = self.retry_after.pop(path, None)
        if pause is not None:
            return 429, b"slow down", {"Retry-After": str(pause)}
        if path in self.pages:
            return 200, self.pages[path], {}
        return 404, b"no", {}

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def linked_pages(count: int, prefix: str = "/p") -> dict[str, bytes]:
    """``/`` and ``count`` pages linking to each other (every page reachable from ``/``)."""
    pages = {}
    for i in range(count):
        links = " ".join(f'<a href="{prefix}{(i * 3 + k) % count}">x</a>' for k in range(1, 4))
        pages[f"{prefix}{i}"] = html(links, f"P{i}")
    pages["/"] = html(" ".join(f'<a href="{prefix}{i}">x</a>' for i in range(0, count, 5)), "Home")
    return pages


@dataclass(frozen=True)
class Verdict:
    """What a server's log shows against the rule in force."""

    requests: int
    min_gap_s: float
    max_in_flight: int
    violations: list[str]


def judge(hits: list[Hit], delay_s: float, max_in_flight: int,
          disallowed: tuple[str, ...] = (), pauses: list[tuple[float, float]] = (),
          tolerance_s: float = TOLERANCE_S) -> Verdict:
    """Per host: gaps between request starts (robots.txt excluded: it is fetched before
    the host's first turn), requests in flight at once, disallowed paths requested, and
    requests started inside a pause ``(from, until)`` (monotonic)."""
    pages = sorted((h for h in hits if h.path != "/robots.txt"), key=lambda h: h.start)
    problems = []
    gaps = [b.start - a.start for a, b in itertools.pairwise(pages)]
    min_gap = min(gaps, default=float("inf"))
    for a, b in itertools.pairwise(pages):
        if b.start - a.start < delay_s - tolerance_s:
            problems.append(f"{a.path} -> {b.path}: starts {b.start - a.start:.3f} s apart "
                            f"(delay {delay_s} s), {time.time() - time.monotonic() + a.start:.3f}")
    # At equal times a start counts before an end: a log with coarse clocks never hides
    # an overlap.
    events = sorted([(h.start, 1) for h in pages] + [(h.end, -1) for h in pages],
                    key=lambda e: (e[0], -e[1]))
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    if most > max_in_flight:
        problems.append(f"{most} requests in flight (limit {max_in_flight})")
    for hit in hits:
        if any(hit.path.startswith(prefix) for prefix in disallowed):
            problems.append(f"disallowed {hit.path} requested")
        for since, until in pauses:
            if since < hit.start < until - tolerance_s:
                problems.append(f"{hit.path} started {until - hit.start:.2f} s before the "
                                "Retry-After pause ended")
    return Verdict(len(pages), min_gap, most, problems)


async def leases_of(mesh: MeshProcess) -> dict[int, tuple[str, float]]:
    nc = await connect(mesh.settings, "test-leases", persistent=False)
    try:
        kv = await nc.jetstream().key_value(LEASES_BUCKET)
        out = {}
        for key in (f"partition.{n}" for n in range(64)):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            raw = orjson.loads(entry.value or b"{}")
            out[int(key.split(".")[1])] = (raw.get("owner", ""), float(raw.get("expires", 0)))
        return out
    finally:
        await nc.close()


def owners_alive(mesh: MeshProcess, killed_pid: int, seen: list[object]) -> bool:
    """No partition is held by the killed fetcher, and all 64 are held."""
    leases = asyncio.run(leases_of(mesh))
    now = time.time()
    held = [owner for owner, expires in leases.values() if owner and expires > now]
    seen[:] = [sorted((p, o, round(e - now, 2)) for p, (o, e) in leases.items())]
    return len(held) == 64 and not any(f"-{killed_pid}-" in owner for owner in held)


def test_three_fetchers_two_tenants_stay_polite_through_a_fetcher_kill(tmp_path: Path) -> None:
    shared = LoggedSite("127.0.0.21", linked_pages(40), answer_s=0.15).start()
    crawl_delay = LoggedSite("127.0.0.22", {**linked_pages(4), "/private": html("secret")},
                             robots=b"User-agent: *\nCrawl-delay: 2\nDisallow: /private\n").start()
    crawl_delay.pages["/"] = html('<a href="/p0">a</a> <a href="/private">p</a>', "Home")
    limited = LoggedSite("127.0.0.23", linked_pages(4), retry_after={"/p1": 3}).start()
    slow = LoggedSite("127.0.0.24", linked_pages(6), answer_s=0.4).start()
    sites = (shared, crawl_delay, limited, slow)
    rules = {shared.hostport: {"delay_s": 0.2, "max_in_flight": 2},
             slow.hostport: {"delay_s": 0.1, "max_in_flight": 1}}
    mesh = MeshProcess(tmp_path / "home", env={
        "CRAWLMESH_FETCHER_REPLICAS": "3",
        "CRAWLMESH_FETCHER_LEASE_S": str(LEASE_S),
        "CRAWLMESH_FETCHER_HOST_DELAYS": '{"127.0.0.*": 0.05}',
        "CRAWLMESH_FETCHER_HOST_RULES": orjson.dumps(rules).decode(),
        "CRAWLMESH_FETCHER_ADAPTIVE_SLOW_S": "1.0",
        "CRAWLMESH_MAX_DELIVER": "4",
        "CRAWLMESH_BACKOFF_S": "1,1,1,1",
    }).start()
    killed: list[int] = []

    async def crawl_as(tenant: str, seeds: tuple[str, ...], out: Path) -> tuple[str, object]:
        tnc = await connect(mesh.settings, f"test-{tenant}",
                            creds=KeyStore(mesh.home).tenant_creds(tenant))
        try:
            job = await submit(tnc, CrawlRequest(seeds=seeds, max_depth=50))
            event = await wait_for_job(tnc, job, show=False)
            await export_results(tnc, job, out)
            return job, event
        finally:
            await tnc.close()

    async def run() -> list[tuple[str, object]]:
        async with TenantControl.open(mesh.settings) as control:
            await control.ensure("b")
        a = asyncio.create_task(crawl_as(DEFAULT_TENANT, tuple(s.base + "/" for s in sites),
                                         tmp_path / "a.jsonl"))
        b = asyncio.create_task(crawl_as("b", (shared.base + "/",), tmp_path / "b.jsonl"))
        await asyncio.to_thread(wait_for, lambda: len(shared.hits) >= 12, 60, "12 requests")
        assert not a.done() and not b.done(), "the crawl finished before the kill"
        killed.append(await asyncio.to_thread(mesh.kill_service, "fetcher"))
        seen: list[object] = []
        kill_at = time.monotonic()
        try:
            await asyncio.to_thread(wait_for, lambda: owners_alive(mesh, killed[0], seen),
                                    6 * LEASE_S, "the killed fetcher's partitions taken over")
        except AssertionError as error:
            raise AssertionError(f"{error}; leases: {seen}") from None
        print(f"partitions of the killed fetcher taken over in {time.monotonic() - kill_at:.1f} s")
        return [await a, await b]

    started = time.monotonic()
    try:
        results = asyncio.run(run())
    finally:
        code = mesh.stop()
        for site in sites:
            site.stop()
    assert code == 0
    for _job, event in results:
        assert event.kind is JobEventKind.COMPLETED, event
    a_urls = [orjson.loads(line)["url"] for line in (tmp_path / "a.jsonl").read_bytes().splitlines()]
    b_urls = [orjson.loads(line)["url"] for line in (tmp_path / "b.jsonl").read_bytes().splitlines()]
    assert len(a_urls) == len(set(a_urls)) and len(b_urls) == len(set(b_urls))
    assert {u for u in b_urls} == {shared.base + p for p in shared.pages}
    # Both tenants crawled the shared host in full: each page requested about twice.
    assert len([h for h in shared.hits if h.path != "/robots.txt"]) >= 2 * len(shared.pages)

    pause_of_429 = [(h.end, h.end + 3) for h in limited.hits if h.path == "/p1"][:1]
    verdicts = {
        "shared": judge(shared.hits, 0.2, 2),
        "crawl-delay": judge(crawl_delay.hits, 2.0, 1, disallowed=("/private",)),
        "429": judge(limited.hits, 0.05, 1, pauses=pause_of_429),
        "slow": judge(slow.hits, 0.1, 1),
    }
    for name, verdict in verdicts.items():
        print(f"{name}: {verdict.requests} requests, min gap {verdict.min_gap_s:.3f} s, "
              f"max in flight {verdict.max_in_flight}")
        for problem in verdict.violations:
            print(f"  {name}: {problem}")
    assert {name: v.violations for name, v in verdicts.items() if v.violations} == {}
    assert [h.path for h in limited.hits].count("/p1") == 2  # 429, then 200 after the pause
    assert time.monotonic() - started < 200


def test_a_small_crawl_takes_turns_with_a_large_one_on_the_same_host(tmp_path: Path) -> None:
    """Tenant ``default`` has a backlog of 150 pages on a host; tenant ``b`` then asks for 5
    pages of the same host. ``b``'s requests take turns with ``default``'s (round-robin per
    tenant on the host, bookings per tenant) instead of waiting behind the whole backlog,
    and the host still sees one request per delay."""
    pages = linked_pages(150)
    small = {f"/s{i}": html(" ".join(f'<a href="/s{k}">x</a>' for k in range(5)), f"S{i}")
             for i in range(5)}
    host = LoggedSite("127.0.0.25", {**pages, **small}).start()
    delay_s = 0.05
    mesh = MeshProcess(tmp_path / "home", env={
        "CRAWLMESH_FETCHER_HOST_DELAYS": orjson.dumps({"127.0.0.*": delay_s}).decode(),
    }).start()

    async def run() -> tuple[int, bool]:
        async with TenantControl.open(mesh.settings) as control:
            await control.ensure("b")
        conns = {t: await connect(mesh.settings, f"test-{t}",
                                  creds=KeyStore(mesh.home).tenant_creds(t))
                 for t in (DEFAULT_TENANT, "b")}
        try:
            big = await submit(conns[DEFAULT_TENANT],
                               CrawlRequest(seeds=(host.base + "/",), max_depth=50))
            big_done = asyncio.create_task(wait_for_job(conns[DEFAULT_TENANT], big, show=False))
            await asyncio.to_thread(wait_for, lambda: len(host.hits) >= 30, 60, "30 requests")
            before = len(host.hits)
            job = await submit(conns["b"], CrawlRequest(seeds=(host.base + "/s0",), max_depth=5))
            event = await wait_for_job(conns["b"], job, show=False)
            assert event.kind is JobEventKind.COMPLETED
            big_running = not big_done.done()
            assert (await big_done).kind is JobEventKind.COMPLETED
            return before, big_running
        finally:
            for nc in conns.values():
                await nc.close()

    try:
        before, big_running = asyncio.run(run())
    finally:
        assert mesh.stop() == 0
        host.stop()
    order = [h.path for h in sorted(host.hits, key=lambda h: h.start)][before:]
    first = next(i for i, path in enumerate(order) if path.startswith("/s"))
    last = max(i for i, path in enumerate(order) if path.startswith("/s"))
    print(f"b's 5 requests at positions {first}..{last} of the host's requests after it "
          f"submitted (the other tenant had ~{150 - before} queued)")
    assert big_running, "the large crawl ended before the small one: nothing was shown"
    assert sorted(p for p in order if p.startswith("/s")) == sorted(small)
    assert last <= 5 * 2 + 10, f"b waited behind the other tenant's backlog: {order[:last + 1]}"
    verdict = judge(host.hits, delay_s, 1)
    assert verdict.violations == []
