"""The chaos suite, short form (issue 8): a crawl survives each kind of fault, exactly once.

Each test crawls a generated multi-host loopback site (:class:`tests.graphsite.GraphSite`,
a few hundred pages, reachable set computed from its own link graph) on the embedded mesh
(:class:`tests.integration.chaosmesh.ChaosMesh`: nats-server with file storage, services as
child processes restarted when they die) while one kind of fault happens at random moments,
then checks (:meth:`tests.integration.chaoscrawl.CrawlReport.problems`): result URLs equal
the reachable set, no URL twice, one completion event, dead letters only for the messages
that genuinely could not be processed, each with its reason.

Randomness (which moments, which replica, how long the server stays down) comes from one
seed, printed; ``CHAOS_SEED=<n>`` replays a run. The long form, with every fault at once,
more pages and the corpus, is ``tests/benchmarks/chaos.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from shared.launcher import SERVICES
from shared.streams import FRONTIER
from tests.graphsite import GraphSite
from tests.integration.chaoscrawl import CrawlReport, crawl_under_faults, until, until_async
from tests.integration.chaosmesh import ChaosMesh
from tests.sites import html

pytestmark = pytest.mark.timeout(240)

PAGES = 150
"""Pages of each test's site (plus 404s and denied branches: ~170 results)."""

CRAWL_TIMEOUT_S = 180.0


@pytest.fixture
def seed() -> int:
    """The run's seed: ``CHAOS_SEED`` or a new one, printed so a failure replays."""
    value = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"chaos seed {value} (replay: CHAOS_SEED={value})")
    return value


@pytest.fixture
def site(seed: int) -> Iterator[GraphSite]:
    graph = GraphSite(PAGES, hosts=3, seed=seed)
    try:
        yield graph
    finally:
        graph.stop()


@pytest.fixture
def meshes(tmp_path: Path) -> Iterator[Callable[..., ChaosMesh]]:
    """Starts a :class:`ChaosMesh` in ``tmp_path``; stops it at teardown."""
    started: list[ChaosMesh] = []

    def start(rng: random.Random, env: dict[str, str] | None = None,
              replicas: dict[str, int] | None = None) -> ChaosMesh:
        mesh = ChaosMesh(tmp_path / "home", env=env or {}, replicas=replicas or {}, rng=rng)
        started.append(mesh)
        return mesh.start()

    try:
        yield start
    finally:
        for mesh in started:
            mesh.stop()


def moments(rng: random.Random, count: int, total: int) -> list[int]:
    """``count`` sorted request counts between 10% and 60% of ``total``: when faults strike."""
    return sorted(rng.randint(total // 10, total * 6 // 10) for _ in range(count))


def check(report: CrawlReport, expected: set[str], seed: int,
          poison: dict[str, str] | None = None) -> None:
    print(report.summary())
    problems = report.problems(expected, poison)
    assert not problems, f"seed {seed}: {problems}"


def test_each_service_sigkilled_at_random_moments(
    seed: int, site: GraphSite, meshes: Callable[..., ChaosMesh],
) -> None:
    rng = random.Random(seed)
    site.start()
    expected = site.reachable()
    mesh = meshes(rng)
    order = rng.sample(SERVICES, len(SERVICES))
    at = moments(rng, len(order), len(expected))

    async def faults(done: Callable[[], bool]) -> None:
        for kind, moment in zip(order, at, strict=True):
            if not await until(lambda m=moment: site.requests >= m, done):
                return
            pid = await asyncio.to_thread(mesh.kill, kind)
            print(f"SIGKILL {kind} (pid {pid}) at {site.requests} requests")

    report = asyncio.run(crawl_under_faults(mesh, site.request(), faults, CRAWL_TIMEOUT_S))
    check(report, expected, seed)
    assert sum(mesh.kills.values()) >= 3, f"seed {seed}: the crawl ended before the kills"


def test_nats_server_sigkilled_and_restarted(
    seed: int, site: GraphSite, meshes: Callable[..., ChaosMesh],
) -> None:
    rng = random.Random(seed)
    site.start()
    expected = site.reachable()
    mesh = meshes(rng)
    at = moments(rng, 2, len(expected))

    async def faults(done: Callable[[], bool]) -> None:
        for moment in at:
            if not await until(lambda m=moment: site.requests >= m, done):
                return
            down_s = rng.uniform(2.0, 5.0)
            print(f"SIGKILL nats-server at {site.requests} requests, down {down_s:.1f} s")
            await asyncio.to_thread(mesh.restart_server, down_s)

    report = asyncio.run(crawl_under_faults(mesh, site.request(), faults, CRAWL_TIMEOUT_S))
    check(report, expected, seed)
    assert mesh.kills["nats-server"] >= 1, f"seed {seed}: the crawl ended before the kill"
    assert mesh.mesh is not None
    restarted = {c.name: c.restarts for c in mesh.mesh.children if c.restarts}
    assert restarted == {}, f"services died instead of reconnecting: {restarted}"
    for kind in SERVICES:
        assert '"reconnected to nats"' in mesh.log(kind), kind


def test_two_replicas_of_each_service_one_killed_for_good(
    seed: int, site: GraphSite, meshes: Callable[..., ChaosMesh],
) -> None:
    rng = random.Random(seed)
    site.start()
    expected = site.reachable()
    mesh = meshes(rng, replicas=dict.fromkeys(SERVICES, 2))
    order = rng.sample(SERVICES, len(SERVICES))
    at = moments(rng, len(order), len(expected))

    async def faults(done: Callable[[], bool]) -> None:
        for kind in SERVICES:  # both replicas up (and holding work) before any goes
            await asyncio.to_thread(mesh.wait_live, kind, 2)
        for kind, moment in zip(order, at, strict=True):
            if not await until(lambda m=moment: site.requests >= m, done):
                return
            name = await asyncio.to_thread(mesh.retire, kind)
            print(f"SIGKILL {name} for good at {site.requests} requests")

    report = asyncio.run(crawl_under_faults(mesh, site.request(), faults, CRAWL_TIMEOUT_S))
    check(report, expected, seed)
    assert sum(mesh.kills.values()) >= 3, f"seed {seed}: the crawl ended before the kills"
    assert mesh.mesh is not None
    assert all(c.restarts == 0 for c in mesh.mesh.children)


class PoisonPage:
    """A page whose request never ends while the fetcher that sent it lives: each request
    waits (up to 120 s) for its own event in :attr:`held`, which the test sets only after
    killing the fetcher holding that request's frontier entry."""

    def __init__(self) -> None:
        self.held: list[threading.Event] = []

    def __call__(self, handler: BaseHTTPRequestHandler) -> None:
        release = threading.Event()
        self.held.append(release)
        release.wait(120)
        body = html("poison")
        with contextlib.suppress(OSError):  # the fetcher is gone
            handler.send_response(200)
            handler.send_header("Content-Type", "text/html")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)


def test_process_killed_holding_a_message_on_its_last_delivery(
    seed: int, site: GraphSite, meshes: Callable[..., ChaosMesh],
) -> None:
    """A page kills the fetcher that fetches it (SIGKILL while its frontier entry is held),
    delivery after delivery, the last one included: the server's MAX_DELIVERIES advisory
    dead-letters it (no handler ever saw it fail) and the job still completes. A page whose
    parsing always fails is dead-lettered by the loop on its last delivery. Those two, and
    only those, are dead letters, each with its reason and a ``failed`` result."""
    rng = random.Random(seed)
    max_deliver = 3
    poison = PoisonPage()
    site.start(routes={"/poison": poison})
    poison_url = site.add_leaf("/poison", linked_from=rng.randrange(1, 20), own_host=True)
    crash_url = site.add_leaf("/crash", linked_from=rng.randrange(1, 20), body=html("crash"))
    expected = site.reachable()
    mesh = meshes(rng, env={"CRAWLMESH_MAX_DELIVER": str(max_deliver),
                            "CRAWLMESH_BACKOFF_S": "1,1,1",
                            "CRAWLMESH_FAULT_INJECT": 'parser:/crash"',
                            # the fetcher waits for the poison page until it is killed
                            "CRAWLMESH_FETCHER_READ_TIMEOUT_S": "150",
                            "CRAWLMESH_FETCHER_TOTAL_TIMEOUT_S": "150"})

    async def faults(done: Callable[[], bool]) -> None:
        nc = await mesh.connect_mesh()
        frontier = 0

        async def only_poison_left() -> bool:
            nonlocal frontier
            frontier = (await nc.jetstream().stream_info(FRONTIER.name)).state.messages
            return frontier == 1

        try:
            while await until(lambda: any(not e.is_set() for e in poison.held), done):
                # Every other frontier entry acked (FRONTIER is a work queue): the kills hit
                # the poison alone, not healthy entries that happen to be in flight too.
                await until_async(only_poison_left)
                pid = await asyncio.to_thread(mesh.kill, "fetcher")
                print(f"SIGKILL fetcher (pid {pid}) holding {poison_url}, request "
                      f"{len(poison.held)}")
                for release in poison.held:
                    release.set()
        finally:
            for release in poison.held:
                release.set()
            await nc.close()

    report = asyncio.run(crawl_under_faults(mesh, site.request(), faults, CRAWL_TIMEOUT_S))
    check(report, expected, seed, poison={poison_url: "max deliveries",
                                          crash_url: "injected fault"})
    letters = report.letter_urls({poison_url: "", crash_url: ""})
    assert str(letters[poison_url].stage) == "fetcher"
    assert letters[poison_url].delivery_count == max_deliver
    assert mesh.kills["fetcher"] == len(poison.held) >= max_deliver
    assert str(letters[crash_url].stage) == "parser"
