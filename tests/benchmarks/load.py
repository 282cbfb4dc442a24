"""Benchmark: a generated site of N pages (100,000 by default) crawled to completion.

Not a test (pytest does not collect it): it prints figures and the command to reproduce
them. No corpus needed: the site is generated here.

The site is served from loopback by a small asyncio HTTP/1.1 server (keep-alive, one
listener per host address, pages generated on request, so serving costs no disk and
little CPU). Page ``/p<i>`` lives on host ``127.0.1.<1 + i mod H>`` and links to its ten
children ``/p<10i+1>`` ... ``/p<10i+10>`` (a tree of depth ~log10 N, so every page is
reachable) and to five pseudo-random other pages (duplicates that dedup must refuse), each
on its own host: about 15 links per page, most of them seen before, as on a real site.

The embedded mesh (``crawlmesh up``, one process per service and nats-server) crawls it
from ``/p0`` with scope ``any``, ``max_depth`` 100 and ``max_pages`` N. While it runs, the
RSS of every process (the launcher, nats-server and each service) is sampled every second
with psutil, and the tenant's ``RESULTS`` count every window; it prints, per window, the
pages stored and the pages/s of that window (so a decay shows), the RSS of each process,
then the peak RSS of each process and the wall time.

Run::

    PYTHONPATH=. python tests/benchmarks/load.py --pages 10000
    PYTHONPATH=. python tests/benchmarks/load.py            # 100,000 pages (long)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from nats.aio.client import Client

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.jobs import job_ended, read_events, submit
from shared.contracts import CrawlRequest, JobEventKind, Scope, ScopeMode
from shared.launcher import running_mesh
from shared.settings import MeshSettings
from shared.tenancy import DEFAULT_TENANT
from tests.sites import free_port

REPO = Path(__file__).resolve().parents[2]
FANOUT = 10
"""Children per page (the tree that makes every page reachable)."""
EXTRA_LINKS = 5
"""Links per page to pseudo-random other pages (already seen, mostly)."""


class GeneratedSite:
    """``pages`` HTML pages spread over ``hosts`` loopback addresses (see module docstring).

    Served by asyncio: one listener per host address on one shared port; HTTP/1.1 with
    keep-alive; ``/robots.txt`` is 404; any other path is 404 too.
    """

    def __init__(self, pages: int, hosts: int) -> None:
        self.pages = pages
        self.hosts = [f"127.0.1.{n + 1}" for n in range(hosts)]
        self.port = 0
        self.served = 0
        self._servers: list[asyncio.Server] = []

    def host_of(self, page: int) -> str:
        return f"{self.hosts[page % len(self.hosts)]}:{self.port}"

    def url(self, page: int) -> str:
        return f"http://{self.host_of(page)}/p{page}"

    def body(self, page: int) -> bytes:
        """The HTML of page ``page``: ~1.5 KB, deterministic."""
        children = range(FANOUT * page + 1, min(FANOUT * page + FANOUT, self.pages - 1) + 1)
        extra = ((page * 7919 + k * 104_729) % self.pages for k in range(1, EXTRA_LINKS + 1))
        links = "".join(f'<li><a href="{self.url(n)}">page {n}</a></li>' for n in
                        (*children, *extra))
        text = f"Generated page {page} of {self.pages}. " * 8
        return (f"<!doctype html><html><head><meta charset=utf-8><title>Page {page}</title>"
                f'<meta name="description" content="page {page}"></head><body><h1>Page {page}'
                f"</h1><p>{text}</p><ul>{links}</ul></body></html>").encode()

    async def start(self) -> None:
        self.port = free_port(self.hosts[0])
        for host in self.hosts:
            self._servers.append(await asyncio.start_server(self._serve, host, self.port,
                                                            backlog=512))

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode("latin-1")
                status, body = "404 Not Found", b"not found"
                if path.startswith("/p") and path[2:].isdigit() and int(path[2:]) < self.pages:
                    status, body = "200 OK", self.body(int(path[2:]))
                    self.served += 1
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                IndexError):
            pass
        finally:
            writer.close()


class RssSampler:
    """Samples the RSS of the mesh's processes, by name (service name, else process name;
    replicas and restarts of one service share its name)."""

    def __init__(self, launcher_pid: int) -> None:
        self.root = psutil.Process(launcher_pid)
        self.peak: dict[str, int] = {}
        self.last: dict[str, int] = {}

    def sample(self) -> None:
        now: dict[str, int] = {}
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                args = process.cmdline()
                rss = process.memory_info().rss
            except psutil.Error:  # exited meanwhile
                continue
            name = args[-1] if "service" in args else ("launcher" if process == self.root
                                                       else process.name())
            now[name] = now.get(name, 0) + rss
        self.last = now
        for name, rss in now.items():
            self.peak[name] = max(self.peak.get(name, 0), rss)


def mib(size: int) -> str:
    return f"{size / (1 << 20):6.1f}"


async def results_count(nc: Client, job: str) -> int:
    info = await nc.jetstream().stream_info("RESULTS", subjects_filter=f"crawl.results.{job}")
    return sum((info.state.subjects or {}).values())


async def crawl(settings: MeshSettings, site: GeneratedSite, sampler: RssSampler,
                window_s: float, timeout_s: float) -> int:
    """Submit, sample until the job's ``completed`` event, print the figures."""
    creds = KeyStore(settings.home).tenant_creds(DEFAULT_TENANT)
    nc = await connect(settings, "bench-load", persistent=False, creds=creds)
    try:
        started = time.monotonic()
        job = await submit(nc, CrawlRequest(seeds=(site.url(0),), max_depth=100,
                                            max_pages=site.pages,
                                            scope=Scope(mode=ScopeMode.ANY)))
        names: list[str] = []
        print(f"job {job} submitted; window {window_s:.0f} s")
        last_count, last_t, windows = 0, started, []
        ended = timed_out = False
        next_window = started + window_s
        while not (ended or timed_out):
            await asyncio.sleep(1.0)
            sampler.sample()
            now = time.monotonic()
            ended = await job_ended(nc.jetstream(), job)
            timed_out = now - started > timeout_s
            if now < next_window and not (ended or timed_out):
                continue
            count = await results_count(nc, job)
            rate = (count - last_count) / (now - last_t)
            windows.append(rate)
            if not names:
                names = sorted(sampler.last)
                print(f"{'t s':>6} {'results':>8} {'pages/s':>8}  RSS MiB: "
                      + " ".join(f"{n:>8}" for n in names))
            print(f"{now - started:6.0f} {count:8d} {rate:8.1f}           "
                  + " ".join(f"{mib(sampler.last.get(n, 0)):>8}" for n in names), flush=True)
            last_count, last_t, next_window = count, now, now + window_s
        wall = time.monotonic() - started
        count = await results_count(nc, job)
        done = (await read_events(nc.jetstream(), job))[-1] if ended else None
        outcome = f"{done.kind.value}, counters {done.counters.model_dump()}" if done else \
            f"TIMEOUT after {timeout_s:.0f} s (figures so far)"
        print(f"\n{outcome}: {count} results, wall {wall:.1f} s, {count / wall:.1f} pages/s "
              f"overall; site served {site.served} page requests")
        full = windows[1:-1] or windows  # first and last windows are partial ramps
        print(f"pages/s per full window: min {min(full):.1f}, max {max(full):.1f}, "
              f"first {full[0]:.1f}, last {full[-1]:.1f}")
        print("peak RSS per process, MiB:")
        for name in sorted(sampler.peak):
            print(f"  {name:<12} {mib(sampler.peak[name])}")
        ok = done is not None and done.kind is JobEventKind.COMPLETED and count == site.pages
        print("OK" if ok else f"FAILED: {count} results for {site.pages} pages")
        return 0 if ok else 1
    finally:
        await nc.close()


def start_mesh(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``crawlmesh up`` as a child process with ``env``."""
    return subprocess.Popen([sys.executable, "-m", "shared.cli.main", "up"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def run(args: argparse.Namespace, env: dict[str, str], home: Path) -> int:
    site = GeneratedSite(args.pages, args.hosts)
    await site.start()
    mesh = start_mesh(env)
    try:
        deadline = time.monotonic() + 60
        while running_mesh(home) is None:
            if mesh.poll() is not None or time.monotonic() > deadline:
                print((mesh.stderr.read() if mesh.stderr else b"").decode()[-3000:])
                return 1
            await asyncio.sleep(0.2)
        os.environ.update(env)
        settings = MeshSettings()
        print(f"mesh up ({settings.nats_url}, home {home}); site of {args.pages} pages on "
              f"{args.hosts} hosts :{site.port}; python {sys.version.split()[0]}, "
              f"{os.cpu_count()} cores")
        return await crawl(settings, site, RssSampler(mesh.pid), args.window, args.timeout)
    finally:
        mesh.send_signal(signal.SIGTERM)
        await asyncio.to_thread(mesh.wait, 120)
        await site.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=100_000, help="pages of the site")
    parser.add_argument("--hosts", type=int, default=8, help="loopback host addresses")
    parser.add_argument("--window", type=float, default=30.0, help="throughput window, s")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="give up after, s")
    parser.add_argument("--keep", action="store_true", help="keep the mesh home folder")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="crawlmesh-load-"))
    env = {**os.environ, "CRAWLMESH_HOME": str(home),
           "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "CRAWLMESH_METRICS_BASE_PORT": "0",
           "CRAWLMESH_FETCHER_HOST_RULES": '{"127.0.1.*": {"delay_s": 0, "max_in_flight": 4}}'}
    try:
        code = asyncio.run(run(args, env, home))
    finally:
        if args.keep:
            print(f"mesh home kept: {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    print(f"reproduce: PYTHONPATH=. python tests/benchmarks/load.py --pages {args.pages} "
          f"--hosts {args.hosts} --window {args.window:g}")
    return code


if __name__ == "__main__":
    sys.exit(main())
