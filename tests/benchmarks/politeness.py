"""Benchmark: the corpus crawled by 1, 2 and 3 fetcher replicas and 2 tenants on the same
hosts; per host, the least gap between request starts and the most requests in flight,
as the hosts saw them, against the rule (20 ms, 4 in flight): zero violations.

Not a test (pytest does not collect it). The corpus' own nginx keeps no log, so this
starts a second nginx serving the same three document roots (the corpus' Debian packages,
installed by ``../shared/corpus/serve start``) on 127.0.0.5-7:8080 with a millisecond access
log, and judges each host from that log.

Run::

    ../shared/corpus/serve start     # installs the corpus packages and nginx
    PYTHONPATH=. python tests/benchmarks/politeness.py [--replicas 1 2 3] [--max-pages N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.jobs import submit, wait_for_job
from shared.contracts import CrawlRequest
from shared.launcher import running_mesh
from shared.settings import MeshSettings
from tests.integration.test_politeness import Hit, judge

REPO = Path(__file__).resolve().parents[2]
HOSTS = ("127.0.0.5", "127.0.0.6", "127.0.0.7")
"""Our own nginx serves the corpus' three sites here (the corpus' nginx keeps no log)."""
PORT = 8080
DELAY_S, IN_FLIGHT = 0.02, 4
IDLE_S = 60
TOLERANCE_S = 0.005
"""The issue's 50 ms tolerance would make a 20 ms rule unfalsifiable: 5 ms here (nginx's
log has millisecond resolution)."""


class LoggedCorpus:
    """An nginx of our own serving the corpus' three document roots on ``hosts``:8080 with a
    millisecond access log: each request's start (``$msec - $request_time``: when its first
    byte was read) and end (``$msec``: when its last byte was handed to the socket).

    nginx is event-driven C with no work of its own between requests, so its clock readings
    are within about a millisecond of the packets' arrival; a Python proxy's event loop,
    busy relaying one body, stamped the next request late and made gaps look shorter.
    """

    PACKAGES = ("python3.11-doc", "postgresql-doc-15", "python-django-doc")

    def __init__(self, hosts: tuple[str, ...], folder: Path) -> None:
        self.hosts, self.folder = hosts, folder
        self.process: subprocess.Popen[bytes] | None = None
        self.skip: dict[str, int] = {}  # bytes of each log written before the crawl

    @staticmethod
    def html_root(package: str) -> str:
        """The folder holding ``package``'s top index.html (as ``serve`` finds it)."""
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True,
                                 check=True).stdout.split()
        return os.path.dirname(sorted(f for f in listing if f.endswith("/html/index.html"))[0])

    def log(self, host: str) -> Path:
        return self.folder / f"{host}.log"

    def start(self) -> None:
        tmp = self.folder / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        servers = "".join(
            f"  server {{ listen {host}:{PORT}; root {self.html_root(package)}; "
            f"access_log {self.log(host)} timed; }}\n"
            for host, package in zip(self.hosts, self.PACKAGES, strict=True))
        temps = " ".join(f"{kind}_temp_path {tmp};"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        config = self.folder / "nginx.conf"
        config.write_text(
            f"daemon off; worker_processes 1; pid {self.folder}/nginx.pid; "
            f"error_log {self.folder}/error.log;\n"
            "events { worker_connections 4096; }\n"
            "http { include /etc/nginx/mime.types; sendfile on; keepalive_requests 100000;\n"
            "  log_format timed '$msec $request_time $status $request_uri';\n"
            f"  {temps}\n{servers}}}\n")
        # Real-time priority when allowed: on a loaded 2-core machine a normal nginx can wait
        # ~100 ms for a core and then stamp a backlog of requests with one cached time.
        realtime = ["chrt", "--fifo", "10"] if shutil.which("chrt") and os.geteuid() == 0 else []
        self.process = subprocess.Popen([*realtime, "nginx", "-c", str(config)],
                                        stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(f"http://{self.hosts[0]}:{PORT}/robots.txt", timeout=1)
                break
            except httpx.TransportError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("nginx did not start: " + (
                        self.process.stderr.read() if self.process.stderr else b"").decode()) \
                        from None
                time.sleep(0.1)
        # the readiness probe is not part of the crawl: judge only what is logged after it
        # (nginx writes each line when its request ends, so the probe's is there by now)
        self.skip = {host: self.log(host).stat().st_size for host in self.hosts}

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

    def hits(self, host: str) -> list[Hit]:
        """Every request ``host`` served, times on this process' ``time.monotonic()`` clock."""
        offset = time.time() - time.monotonic()
        out = []
        with self.log(host).open("rb") as log:
            log.seek(self.skip[host])
            lines = log.read().decode().splitlines()
        for line in lines:
            msec, took, _status, path = line.split(" ", 3)
            end = float(msec) - offset
            out.append(Hit(path, end - float(took), end))
        return out


async def crawl(settings: MeshSettings, tenants: list[str], seeds: list[str],
                max_pages: int) -> dict[str, int]:
    keys = KeyStore(settings.home)
    async with TenantControl.open(settings) as control:
        for tenant in tenants:
            await control.ensure(tenant)

    async def one(tenant: str) -> tuple[str, int]:
        nc = await connect(settings, f"bench-{tenant}", persistent=False,
                           creds=keys.tenant_creds(tenant))
        try:
            job = await submit(nc, CrawlRequest(seeds=tuple(seeds), max_depth=100,
                                                max_pages=max_pages))
            event = await wait_for_job(nc, job, show=False)
            return tenant, event.counters.finished
        finally:
            await nc.close()

    return dict(await asyncio.gather(*(one(t) for t in tenants)))


def start_mesh(home: Path, replicas: int) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    from tests.sites import free_port

    rules = {host: {"delay_s": DELAY_S, "max_in_flight": IN_FLIGHT} for host in HOSTS}
    env = {**os.environ, "CRAWLMESH_HOME": str(home),
           "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "CRAWLMESH_METRICS_BASE_PORT": "0",
           "CRAWLMESH_FETCHER_REPLICAS": str(replicas),
           "CRAWLMESH_FETCHER_LEASE_S": "5",
           "CRAWLMESH_FETCHER_HOST_RULES": orjson.dumps(rules).decode()}
    mesh = subprocess.Popen([sys.executable, "-m", "shared.cli.main", "up"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while running_mesh(home) is None:
        if mesh.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((mesh.stderr.read() if mesh.stderr else b"").decode()[-3000:])
        time.sleep(0.2)
    return mesh, env


async def run_once(replicas: int, max_pages: int, keep: bool = False) -> bool:
    home = Path(tempfile.mkdtemp(prefix="crawlmesh-polite-"))
    site = LoggedCorpus(HOSTS, home / "nginx")
    site.start()
    mesh, env = start_mesh(home, replicas)
    try:
        settings = MeshSettings(home=home, nats_url=env["CRAWLMESH_NATS_URL"])
        seeds = [f"http://{host}:{PORT}/index.html" for host in HOSTS]
        started = time.monotonic()
        task = asyncio.create_task(crawl(settings, ["a", "b"], seeds, max_pages))
        while not task.done():  # a job that never completes: stop once the hosts are idle
            await asyncio.wait({task}, timeout=1.0)
            last = max(site.log(host).stat().st_mtime for host in HOSTS)
            if not task.done() and time.time() - last > IDLE_S:
                task.cancel()
        finished = {f"(not completed: hosts idle for {IDLE_S} s)": 0} \
            if task.cancelled() else task.result()
        took = time.monotonic() - started
    finally:
        mesh.terminate()
        mesh.wait(60)
        site.stop()
    ok = True
    print(f"\n{replicas} fetcher(s), tenants a and b: pages finished {finished} in {took:.1f} s")
    print(f"  {'host':<16} {'requests':>8} {'min gap (s)':>12} {'rule':>6} "
          f"{'max in flight':>14} {'rule':>5} violations")
    for host in HOSTS:
        verdict = judge(site.hits(host), DELAY_S, IN_FLIGHT, tolerance_s=TOLERANCE_S)
        ok = ok and not verdict.violations
        print(f"  {host + ':8080':<16} {verdict.requests:>8} {verdict.min_gap_s:>12.4f} "
              f"{DELAY_S:>6} {verdict.max_in_flight:>14} {IN_FLIGHT:>5} {len(verdict.violations)}")
        for problem in verdict.violations[:5]:
            print(f"    {problem}")
    if ok and not keep:
        shutil.rmtree(home, ignore_errors=True)
    else:
        print(f"  logs kept in {home} (nginx/<host>.log, logs/<service>.log)")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-pages", type=int, default=100_000, help="per job")
    parser.add_argument("--keep", action="store_true", help="keep the logs and mesh home")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores; rule per host: "
          f"{DELAY_S * 1000:.0f} ms between starts, {IN_FLIGHT} in flight")
    ok = all([asyncio.run(run_once(n, args.max_pages, args.keep)) for n in args.replicas])
    print("\nOK: zero violations" if ok else "\nFAILED: violations")
    print("reproduce: ../shared/corpus/serve start && PYTHONPATH=. python tests/benchmarks/politeness.py "
          + " ".join(sys.argv[1:]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
