"""The mesh on a three-node JetStream cluster survives losing a server in mid-crawl.

Three nats-server processes on loopback run the config ``crawlmesh init`` writes for the
compose ``cluster`` profile (:class:`shared.cli.bootstrap.ServerPlan`: operator mode, the
full resolver, a ``cluster`` block with routes to all three, ``server_name`` from
``$NATS_SERVER_NAME``); each has its own store and resolver folder, as each container has
its own volume. ``crawlmesh init --wait`` with ``CRAWLMESH_REPLICAS=3`` creates every
stream, bucket and the ``default`` tenant with three replicas; the five services run as
child processes of the launcher (:class:`shared.launcher.EmbeddedMesh`, what ``crawlmesh
up`` runs) with the three servers' URLs. In the middle of a crawl of a loopback site the
server most service processes are connected to is SIGKILLed (so they must reconnect to
another, and the streams it led elect new leaders); the crawl completes with every
reachable page exactly once and one completion event, and no service process died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.bootstrap import SERVER_NAME_ENV, ServerPlan
from shared.cli.jobs import export_results, read_events, submit, wait_for_job
from shared.contracts import CrawlRequest, JobEventKind
from shared.launcher import SERVICES, EmbeddedMesh
from shared.natsserver import EmbeddedServer
from shared.settings import MeshSettings
from shared.streams import FRONTIER, LINKS, MESH_STREAMS, RESULTS
from shared.tenancy import DEFAULT_TENANT
from tests.sites import Site, free_port, html, wait_for

pytestmark = pytest.mark.timeout(120)

PAGES = 80
"""Pages of the test site, all reachable from ``/``."""


@dataclass
class Node:
    """One server of the cluster and its monitoring port."""

    name: str
    server: EmbeddedServer
    monitor_port: int

    def get(self, path: str) -> tuple[int, bytes]:
        """``GET http://127.0.0.1:<monitor port><path>``: (status, body); 0 if unreachable."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}{path}",
                                        timeout=2) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except OSError:
            return 0, b""

    def healthy(self) -> bool:
        """``/healthz`` answers 200: JetStream is up and current (the compose healthcheck)."""
        return self.get("/healthz")[0] == 200

    def services_connected(self) -> list[str]:
        """Names of the mesh service connections (``crawlmesh-<service>``) on this server."""
        status, body = self.get("/connz?limit=1024")
        assert status == 200, body
        return sorted(str(conn.get("name", "")) for conn in orjson.loads(body)["connections"]
                      if str(conn.get("name", "")).removeprefix("crawlmesh-") in SERVICES)


def site_pages(count: int) -> dict[str, tuple[int, str, bytes]]:
    """``/`` linking to every 10th page, each page linking to three others: all reachable,
    most only through other pages (so the crawl has depth)."""
    pages = {f"/p{i}": (200, "text/html", html(" ".join(
        f'<a href="/p{(i * 7 + k) % count}">x</a>' for k in (1, 2, 3)), f"P{i}"))
        for i in range(count)}
    pages["/"] = (200, "text/html", html(" ".join(
        f'<a href="/p{i}">x</a>' for i in range(0, count, 10)), "Home"))
    return pages


def reachable(pages: dict[str, tuple[int, str, bytes]]) -> set[str]:
    """Paths reachable from ``/`` by following the pages' links."""
    seen, todo = {"/"}, ["/"]
    while todo:
        body = pages[todo.pop()][2].decode()
        for part in body.split('href="')[1:]:
            path = part.split('"', 1)[0]
            if path not in seen:
                seen.add(path)
                todo.append(path)
    return seen


def node_home(home: Path, name: str) -> Path:
    """A server's own folder: its store and resolver, the operator's keys and JWTs linked
    from ``home`` (in compose each server mounts its own volume at the same path)."""
    own = home / "servers" / name
    own.mkdir(parents=True)
    for shared_dir in ("keys", "jwt"):
        (own / shared_dir).symlink_to(home / shared_dir)
    return own


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Node]]:
    """Three clustered nats-servers in operator mode on loopback, stopped at teardown."""
    home = tmp_path / "home"
    KeyStore(home).init_operator()
    names = ("nats-1", "nats-2", "nats-3")
    route_ports = [free_port() for _ in names]
    routes = ",".join(f"nats-route://127.0.0.1:{port}" for port in route_ports)
    settings = MeshSettings(home=home, replicas=3)
    nodes: list[Node] = []
    try:
        for name, route_port in zip(names, route_ports, strict=True):
            own = node_home(home, name)
            plan = ServerPlan.from_options(settings, own / "nats.conf", f"127.0.0.1:{free_port()}",
                                           free_port(), routes)
            plan = dataclasses.replace(plan, cluster_listen=f"127.0.0.1:{route_port}")
            config = plan.write(settings.model_copy(update={"home": own}), KeyStore(own))
            monkeypatch.setenv(SERVER_NAME_ENV, name)  # read by the server at start
            server = EmbeddedServer(config=config, log_path=own / "nats.log")
            nodes.append(Node(name, server, plan.monitor_port or 0))
            server.start()
        monkeypatch.delenv(SERVER_NAME_ENV)
        wait_for(lambda: all(node.healthy() for node in nodes), 60, "/healthz of all three")
        yield nodes
    finally:
        for node in nodes:
            node.server.stop()


def init_cluster(home: Path, url: str) -> str:
    """``crawlmesh init --wait 60`` with three replicas; returns its output."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CRAWLMESH_")},
           "CRAWLMESH_HOME": str(home), "CRAWLMESH_NATS_URL": url, "CRAWLMESH_REPLICAS": "3"}
    done = subprocess.run([sys.executable, "-m", "shared.cli.main", "init", "--wait", "60"],
                          env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stderr


async def replica_counts(settings: MeshSettings) -> dict[str, tuple[int, int]]:
    """``{stream: (configured replicas, servers holding it)}`` of the MESH streams and the
    default tenant's RESULTS."""
    out: dict[str, tuple[int, int]] = {}
    nc = await connect(settings, "test-replicas", persistent=False)
    tnc = await connect(settings, "test-replicas-tenant", persistent=False,
                        creds=KeyStore(settings.home).tenant_creds(DEFAULT_TENANT))
    try:
        for js, name in [*((nc.jetstream(), s.name) for s in MESH_STREAMS),
                         (tnc.jetstream(), RESULTS)]:
            info = await js.stream_info(name)
            assert info.cluster is not None, name
            holders = 1 + len(info.cluster.replicas or [])
            out[name] = (info.config.num_replicas or 0, holders)
    finally:
        await tnc.close()
        await nc.close()
    return out


async def leaders(settings: MeshSettings) -> dict[str, str]:
    """``{MESH stream: name of the server leading it}``."""
    nc = await connect(settings, "test-leaders", persistent=False)
    try:
        out = {}
        for spec in MESH_STREAMS:
            info = await nc.jetstream().stream_info(spec.name)
            out[spec.name] = info.cluster.leader if info.cluster else ""
        return out
    finally:
        await nc.close()


def test_crawl_completes_when_a_server_of_the_cluster_dies(
    cluster: list[Node], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = tmp_path / "home"
    url = ",".join(node.server.url for node in cluster)
    print(init_cluster(home, url))
    settings = MeshSettings(home=home, nats_url=url, replicas=3, metrics_base_port=0,
                            max_deliver=5, backoff_s=(1.0, 1.0, 2.0, 2.0, 2.0))
    counts = asyncio.run(replica_counts(settings))
    assert counts == {name: (3, 3) for name in counts}, counts
    assert {LINKS.name, FRONTIER.name, RESULTS} <= set(counts)

    site = Site(pages=site_pages(PAGES)).start()
    expected = {site.url(path) for path in reachable(site.pages)}
    assert len(expected) > 50
    for name, value in {
        "CRAWLMESH_REPLICAS": "3", "CRAWLMESH_MAX_DELIVER": str(settings.max_deliver),
        "CRAWLMESH_BACKOFF_S": ",".join(str(s) for s in settings.backoff_s),
        "CRAWLMESH_METRICS_BASE_PORT": "0",
        "CRAWLMESH_FETCHER_HOST_RULES": '{"127.0.0.*": {"delay_s": 0, "max_in_flight": 4}}',
    }.items():
        monkeypatch.setenv(name, value)
    mesh = EmbeddedMesh(settings, replicas={})
    mesh.url = url  # the services get all three servers (CRAWLMESH_NATS_URL)
    mesh.start_services()
    killed: list[str] = []
    moved: list[str] = []
    started = time.monotonic()

    async def crawl() -> tuple[object, list[dict[str, object]], int]:
        tnc = await connect(settings, "test-tenant",
                            creds=KeyStore(home).tenant_creds(DEFAULT_TENANT))
        try:
            job = await submit(tnc, CrawlRequest(seeds=(site.url("/"),), max_depth=50), 60)
            waiting = asyncio.create_task(wait_for_job(tnc, job, show=False))
            await asyncio.to_thread(wait_for, lambda: len(site.requests) >= 25, 60,
                                    "25 requests to the site")
            # The victim: the server most service processes are connected to (at least two
            # of the five), so reconnecting is exercised, not only stream leader elections.
            connected = {node.name: node.services_connected() for node in cluster}
            victim = max(cluster, key=lambda node: len(connected[node.name]))
            moved.extend(connected[victim.name])
            leads = await leaders(settings)
            victim.server.kill()
            killed.append(victim.name)
            kill_at = time.monotonic()
            print(f"killed {victim.name} after {len(site.requests)} requests "
                  f"({time.monotonic() - started:.1f} s); connected there: "
                  f"{connected[victim.name]}; leading: "
                  f"{sorted(s for s, leader in leads.items() if leader == victim.name)}")
            event = await asyncio.wait_for(waiting, 80)
            print(f"completed {time.monotonic() - kill_at:.1f} s after the kill")
            out = tmp_path / "results.jsonl"
            await export_results(tnc, job, out)
            results = [orjson.loads(line) for line in out.read_bytes().splitlines()]
            events = await read_events(tnc.jetstream(), job)
            completions = sum(e.kind is JobEventKind.COMPLETED for e in events)
            return event, results, completions
        finally:
            await tnc.close()

    try:
        event, results, completions = asyncio.run(crawl())
        exited = {child.name: child.process.poll() for child in mesh.children
                  if child.process is not None and child.process.poll() is not None}
    finally:
        mesh.stop()
        site.stop()
    print(f"crawl of {len(results)} pages with a server killed: {time.monotonic() - started:.1f} s")
    assert killed
    assert event.kind is JobEventKind.COMPLETED, event
    urls = [str(result["url"]) for result in results]
    assert len(urls) == len(set(urls)), "a page was delivered twice"
    assert set(urls) == expected
    assert {result["outcome"] for result in results} == {"ok"}, results
    assert completions == 1
    assert exited == {}, f"service processes died: {exited}"
    assert len(moved) >= 2, moved  # five connections on three servers
    for connection in moved:
        service = connection.removeprefix("crawlmesh-")
        assert '"reconnected to nats"' in (home / "logs" / f"{service}.log").read_text(), service
    assert sorted(child.name for child in mesh.children) == sorted(SERVICES)
