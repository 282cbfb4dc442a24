"""Hostile input end to end: pages, servers and submissions meant to break a crawler.

One embedded mesh (``crawlmesh up``: the five service processes and nats-server) serves the
module. Its fetcher caps bodies at 16 MiB, times a silent server out after 2 s and a whole
request after 4 s, and does not retry (so hostile servers cost seconds, not minutes).

- **Pages** (one job): 1,000-deep nesting, NUL bytes, 1 MiB attributes, a page of a million
  links (14 MB, so its body travels through the Object Store; its outlinks reach dedup as
  one message of at most ``max_links`` links), invalid byte sequences in the declared
  encoding (UTF-8 and Shift_JIS), a page 10x the body cap and an endless chunked body.
- **Servers** (one job, scope ``any``): slowloris (one byte per second), one that accepts
  and never answers, one that resets the connection mid-body, and an endless redirect chain
  that bounces between two hosts.
- **Submissions** at the tenant's intake while a good job runs: not a URL, non-HTTP
  schemes, an oversized request, invalid JSON, unknown fields, non-UTF-8 bytes, limits over
  the tenant's caps.

Each hostile page or server yields its one result (possibly with an error) and the job
completes; each bad submission gets a ``rejected`` event with a clear reason; no service
process dies or restarts, and the good job completes with every page.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import orjson
import pytest

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.jobs import export_results, read_events, submit, wait_for_job
from shared.contracts import CrawlRequest, JobEvent, JobEventKind, Scope, ScopeMode
from shared.launcher import SERVICES
from shared.tenancy import DEFAULT_TENANT
from tests.integration.meshproc import MeshProcess
from tests.sites import Site, html, ring_site

pytestmark = pytest.mark.timeout(300)

BODY_CAP = 16 << 20
"""The mesh's fetcher body cap in this module (bytes)."""

MESH_ENV = {
    "CRAWLMESH_FETCHER_MAX_BODY_BYTES": str(BODY_CAP),
    "CRAWLMESH_FETCHER_READ_TIMEOUT_S": "2",
    "CRAWLMESH_FETCHER_TOTAL_TIMEOUT_S": "4",
    "CRAWLMESH_FETCHER_CONNECT_TIMEOUT_S": "2",
    "CRAWLMESH_FETCHER_HTTP_RETRIES": "0",
    "CRAWLMESH_BACKOFF_S": "2,2,2",  # the first step is the ack wait: 2 s as in production
}


# ---- hostile pages -----------------------------------------------------------------------

def page(title: bytes, body: bytes, head: bytes = b"") -> bytes:
    return (b"<html><head>" + head + b"<title>" + title + b"</title></head><body>"
            + body + b"</body></html>")


MILLION_LINKS = page(b"Million", b"".join(b"<a href=%d>" % n for n in range(1_000_000)))

HOSTILE_PAGES: dict[str, tuple[str, bytes]] = {
    "/deep": ("text/html", page(b"Deep", b"<div>" * 1000 + b'<a href="/deep-end">end</a>'
                                + b"</div>" * 1000)),
    "/nul": ("text/html", page(b"N\x00U\x00L", b"\x00" * 5000 + b'<a href="/nul\x00-end">x</a>'
                               + b"\x00<p>\x00</p>" * 1000)),
    "/attrs": ("text/html", page(
        b"Attrs", b'<a title="' + b"t" * (1 << 20) + b'" href="/attrs-end">ok</a><a href="/'
        + b"h" * (1 << 20) + b'">too long</a><div class="' + b"c " * (1 << 19) + b'"></div>',
        head=b'<meta name="description" content="' + b"d" * (1 << 20) + b'">')),
    "/million": ("text/html", MILLION_LINKS),
    "/bad-utf8": ("text/html; charset=utf-8", page(b"Caf\xe9", b"\xc3\x28 \xe2\x82 \xf0\x28\x8c"
                                                   b"\xbc \xed\xa0\x80 \xff\xfe ok")),
    "/bad-sjis": ("text/html; charset=shift_jis", page(b"x", b"\x81\x00\x82\xff\xa0\xfd ok",
                                                       head=b"<meta charset=shift_jis>")),
}


def oversized(handler: BaseHTTPRequestHandler) -> None:
    """A page declared (and sent, as long as the client reads) 10x the body cap."""
    size = 10 * BODY_CAP
    handler.send_response(200)
    handler.send_header("Content-Type", "text/html")
    handler.send_header("Content-Length", str(size))
    handler.end_headers()
    chunk = b"<p>" + b"x" * 65_530 + b"</p>"
    try:
        for _ in range(size // len(chunk)):
            handler.wfile.write(chunk)
    except OSError:  # the fetcher hung up at its cap
        pass


def endless(handler: BaseHTTPRequestHandler) -> None:
    """A chunked body that never ends."""
    handler.protocol_version = "HTTP/1.1"
    handler.send_response(200)
    handler.send_header("Content-Type", "text/html")
    handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    chunk = b"<p>" + b"y" * 65_000 + b"</p>"
    try:
        while True:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except OSError:
        pass


def pages_site() -> Site:
    site = Site()
    links = "".join(f'<a href="{path}">{path}</a> ' for path in (*HOSTILE_PAGES, "/huge",
                                                                  "/endless"))
    site.pages = {"/": (200, "text/html", html(links, "Hostile pages")),
                  "/robots.txt": (404, "text/plain", b"")}
    site.pages.update({path: (200, ctype, body) for path, (ctype, body) in HOSTILE_PAGES.items()})
    site.routes = {"/huge": oversized, "/endless": endless}
    return site.start()


# ---- hostile servers ---------------------------------------------------------------------

@dataclass
class RawServer:
    """A loopback TCP server running ``serve(connection)`` in a thread per connection."""

    serve: Callable[[socket.socket], None]
    sock: socket.socket = field(default_factory=socket.socket)
    accepted: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def start(self) -> RawServer:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.serve(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def slowloris(conn: socket.socket, stop: threading.Event) -> None:
    """Headers, then one byte of body per second (for a minute)."""
    request = read_request(conn)
    if request.startswith(b"GET /robots.txt"):
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        return
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 100\r\n\r\n")
    for _ in range(60):
        if stop.wait(1.0):
            return
        conn.sendall(b"x")


def never_answers(conn: socket.socket, stop: threading.Event) -> None:
    """Answers robots.txt (404), then accepts page requests and never answers them."""
    if read_request(conn).startswith(b"GET /robots.txt"):
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        return
    stop.wait(60)


def mute(conn: socket.socket, stop: threading.Event) -> None:
    """Accepts, reads nothing, says nothing: not even robots.txt."""
    stop.wait(60)


def resets_mid_body(conn: socket.socket, stop: threading.Event) -> None:
    """Half of the promised body, then a TCP reset (SO_LINGER 0)."""
    request = read_request(conn)
    if request.startswith(b"GET /robots.txt"):
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        return
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 20000\r\n\r\n"
                 + b"<html><body>" + b"z" * 10_000)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


@dataclass
class Servers:
    start: Site
    bounce: tuple[Site, Site]
    raw: dict[str, RawServer]
    stop: threading.Event


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    stop = threading.Event()
    raw = {name: RawServer(lambda conn, f=serve: f(conn, stop)).start() for name, serve in (
        ("slowloris", slowloris), ("never", never_answers), ("reset", resets_mid_body),
        ("mute", mute))}
    a, b = Site(), Site()
    for this, other in ((a, b), (b, a)):
        def bounce(handler: BaseHTTPRequestHandler, other: Site = other) -> None:
            n = int(handler.path.rsplit("/", 1)[1])
            handler.send_response(302)
            handler.send_header("Location", other.url(f"/r/{n + 1}"))
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        this.routes = {f"/r/{n}": bounce for n in range(1000)}
        this.pages = {"/robots.txt": (404, "text/plain", b"")}
        this.start()
    start = Site()
    links = "".join(f'<a href="{server.base}/{name}">{name}</a> ' for name, server in raw.items())
    start.pages = {"/": (200, "text/html", html(links + f'<a href="{a.url("/r/0")}">loop</a>',
                                                "Hostile servers")),
                   "/robots.txt": (404, "text/plain", b"")}
    start.start()
    try:
        yield Servers(start, (a, b), raw, stop)
    finally:
        stop.set()
        for server in raw.values():
            server.stop()
        for site in (start, a, b):
            site.stop()


# ---- the mesh and helpers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcess]:
    process = MeshProcess(tmp_path_factory.mktemp("hostile") / "home", env=dict(MESH_ENV)).start()
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log("launcher")


def pids(mesh: MeshProcess) -> dict[str, list[int]]:
    return {name: sorted(mesh.service_pids(name)) for name in SERVICES}


async def crawl(mesh: MeshProcess, request: CrawlRequest, out: Path,
                timeout_s: float = 180) -> tuple[JobEvent, dict[str, dict]]:
    """Submit as the default tenant, wait for the end, return the final event and the
    results by URL."""
    creds = KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT)
    tnc = await connect(mesh.settings, "hostile-client", creds=creds)
    try:
        job = await submit(tnc, request)
        event = await asyncio.wait_for(wait_for_job(tnc, job, show=False), timeout_s)
        await export_results(tnc, job, out)
    finally:
        await tnc.close()
    results = [orjson.loads(line) for line in (await asyncio.to_thread(out.read_bytes)).splitlines()
               if line.strip()]
    by_url = {r["url"]: r for r in results}
    assert len(by_url) == len(results), "a URL has two results"
    return event, by_url


def dedup_links(mesh: MeshProcess) -> dict[str, float]:
    """``crawlmesh_dedup_links_total`` of the dedup process, by decision (all tenants)."""
    text = httpx.get(f"{mesh.metrics['dedup']}/metrics", timeout=5).text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("crawlmesh_dedup_links_total{"):
            decision = line.split('decision="', 1)[1].split('"', 1)[0]
            counts[decision] = counts.get(decision, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


# ---- tests -------------------------------------------------------------------------------

def test_hostile_pages_each_yield_a_result_and_the_job_completes(
    mesh: MeshProcess, tmp_path: Path
) -> None:
    site = pages_site()
    before = pids(mesh)
    try:
        final, by_url = asyncio.run(crawl(mesh, CrawlRequest(
            seeds=(site.url("/"),), max_depth=2, max_pages=40), tmp_path / "pages.jsonl"))
    finally:
        site.stop()
    results = {url.removeprefix(site.base): r for url, r in by_url.items()}

    assert final.kind is JobEventKind.COMPLETED
    assert final.counters.admitted == final.counters.finished == len(by_url) == 40
    assert final.counters.failed == 0  # every hostile page gave a result, none a dead letter
    assert {"/deep", "/nul", "/attrs", "/million", "/bad-utf8", "/bad-sjis", "/huge",
            "/endless"} <= set(results)
    for path in ("/deep", "/nul", "/attrs", "/million", "/bad-utf8", "/bad-sjis"):
        assert results[path]["outcome"] == "ok" and results[path]["error"] is None, results[path]
    assert results["/deep"]["title"] == "Deep" and "/deep-end" in results
    assert "\x00" not in results["/nul"]["title"] and results["/nul"]["title"].startswith("N")
    assert "/attrs-end" in results
    assert len(results["/attrs"]["description"]) == 4096  # cut, not a 1 MiB string
    assert results["/bad-utf8"]["title"] == "Caf\ufffd"
    for path in ("/huge", "/endless"):
        assert results[path]["outcome"] == "fetch_error", results[path]
        assert results[path]["error"] == f"body exceeds {BODY_CAP} bytes (decompressed)"
    # The million links reached dedup as one message of at most 10,000 (max_links) links:
    # dedup decided about 10,000 + the few of the other pages (twice if the 14 MB page was
    # redelivered to the parser while it was parsed), not a million; none dead-lettered.
    decided = dedup_links(mesh)
    assert 10_000 <= sum(decided.values()) < 2 * 10_100, decided
    assert decided.get("over_budget", 0) > 9_000
    assert pids(mesh) == before, "a service process died and was restarted"


def test_hostile_servers_each_yield_an_error_result_and_the_job_completes(
    mesh: MeshProcess, servers: Servers, tmp_path: Path
) -> None:
    before = pids(mesh)
    final, by_url = asyncio.run(crawl(mesh, CrawlRequest(
        seeds=(servers.start.url("/"),), max_depth=1, max_pages=100,
        scope=Scope(mode=ScopeMode.ANY)), tmp_path / "servers.jsonl"))

    assert final.kind is JobEventKind.COMPLETED
    assert final.counters.failed == 0
    assert final.counters.admitted == final.counters.finished == len(by_url)
    raw = {name: by_url[f"{server.base}/{name}"] for name, server in servers.raw.items()}
    for name in ("slowloris", "never", "reset"):
        assert raw[name]["outcome"] == "fetch_error" and raw[name]["error"], (name, raw[name])
    assert "timed out after 4" in raw["slowloris"]["error"], raw["slowloris"]
    assert "ReadTimeout" in raw["never"]["error"], raw["never"]
    assert "Connection reset by peer" in raw["reset"]["error"], raw["reset"]
    # A host whose robots.txt is unreachable is disallowed for now (RFC 9309 §2.3.1.4).
    assert raw["mute"]["outcome"] == "robots_disallowed", raw["mute"]
    # The redirect chain bounces between two hosts: each hop goes back through dedup (the
    # target host's robots.txt and budget apply) and ends within the redirect limit.
    a, b = servers.bounce
    hops = [r for url, r in by_url.items() if "/r/" in url]
    assert hops, by_url.keys()
    requested = [p for p in a.requests + b.requests if p.startswith("/r/")]
    assert len(requested) <= 6, f"{len(requested)} hops of an endless redirect chain fetched"
    assert any("redirect" in (r["error"] or "") for r in hops), hops
    assert pids(mesh) == before, "a service process died and was restarted"


BAD_SUBMISSIONS: tuple[tuple[bytes, str], ...] = (
    (b"not a url at all", "not an absolute URL"),
    (b"ftp://127.0.0.1/file", "unsupported scheme 'ftp'"),
    (b"javascript:alert(1)", "unsupported scheme 'javascript'"),
    (b'{"seeds": ["file:///etc/passwd"]}', "unsupported scheme 'file'"),
    (b'{"seeds": ["http://127.0.0.1/"], "label": "' + b"x" * 300_000 + b'"}', "the limit is"),
    (b'{"seeds": ["http://127.0.0.1/"], "max_pages": ', "invalid JSON"),
    (b'{"seeds": ["http://127.0.0.1/"], "priority": 9}', "priority: Extra inputs are not permitted"),
    (b"\xff\xfe\x00h\x00t", "not UTF-8"),
    (b'{"seeds": ["http://127.0.0.1/"], "max_pages": 100001}',
     "max_pages 100001 exceeds this tenant's limit of 100000 pages per job"),
    (b'{"seeds": ["http://127.0.0.1/"], "max_depth": 1000}', "max_depth"),
)


def test_bad_submissions_are_rejected_clearly_and_a_running_job_is_not_disturbed(
    mesh: MeshProcess, tmp_path: Path
) -> None:
    site = ring_site(60, fanout=3)
    before = pids(mesh)

    async def run() -> tuple[JobEvent, dict[str, dict], list[JobEvent]]:
        creds = KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT)
        tnc = await connect(mesh.settings, "hostile-intake", creds=creds)
        try:
            tjs = tnc.jetstream()
            good = asyncio.create_task(crawl(mesh, CrawlRequest(
                seeds=(site.url("/p0"),), max_depth=100), tmp_path / "good.jsonl"))
            seen = {e.job_id for e in await read_events(tjs)}
            for payload, _ in BAD_SUBMISSIONS:
                await tjs.publish("crawl.seeds", payload)
            rejected: list[JobEvent] = []
            deadline = time.monotonic() + 60
            while len(rejected) < len(BAD_SUBMISSIONS) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                rejected = [e for e in await read_events(tjs)
                            if e.kind is JobEventKind.REJECTED and e.job_id not in seen]
            final, by_url = await good
            return final, by_url, rejected
        finally:
            await tnc.close()

    try:
        final, by_url, rejected = asyncio.run(run())
    finally:
        site.stop()
    reasons = [e.reason or "" for e in rejected]
    assert len(rejected) == len(BAD_SUBMISSIONS), reasons
    for _, expected in BAD_SUBMISSIONS:
        assert sum(expected in reason for reason in reasons) == 1, (expected, reasons)
    assert all(len(reason) < 500 for reason in reasons), "a reason should be one clear line"
    assert final.kind is JobEventKind.COMPLETED
    assert set(by_url) == {site.url(f"/p{i}") for i in range(60)}
    assert final.counters.finished == 60 and final.counters.failed == 0
    assert pids(mesh) == before


def test_a_seed_the_egress_policy_refuses_gets_a_clear_error_result(
    mesh: MeshProcess, tmp_path: Path
) -> None:
    """The embedded mesh allows loopback (127.0.0.0/8) only: a link-local (cloud metadata)
    or private address is refused before any connection, and the job still completes."""
    final, by_url = asyncio.run(crawl(mesh, CrawlRequest(
        seeds=("http://169.254.169.254/latest/meta-data/", "http://10.255.255.1/")),
        tmp_path / "egress.jsonl", timeout_s=60))
    assert final.kind is JobEventKind.COMPLETED
    for url in ("http://169.254.169.254/latest/meta-data/", "http://10.255.255.1/"):
        assert by_url[url]["outcome"] == "fetch_error"
        assert by_url[url]["error"].startswith("egress policy refuses"), by_url[url]
