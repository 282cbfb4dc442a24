"""Chaos, long form (issue 8): every fault at once while crawling thousands of pages.

Not a test (pytest does not collect it): it prints the seed, what it did and the figures.
The short form is ``tests/integration/test_chaos.py``.

On an embedded mesh with **two replicas of every service** (nats-server with JetStream
file storage; a dead service is restarted by the launcher):

1. a generated site (:class:`tests.graphsite.GraphSite`, ``--pages`` pages over
   ``--hosts`` loopback hosts, reachable set from its own link graph) with two poison pages:
   ``/crash`` (its parsing always fails: fault injection) and ``/poison`` on a host of its
   own (its request hangs until the fetcher holding it is SIGKILLed, delivery after
   delivery, the last one included). While it is crawled, at random moments (exponential
   gaps of mean ``--every`` seconds): SIGKILL a random process of a random service kind
   (the launcher restarts it), SIGKILL nats-server and start it again after 2-6 s
   (``--server-restarts`` times), and retire one replica of each kind for good. Once
   only ``/poison`` is left in the frontier, the fetcher holding it is SIGKILLed until
   it is dead-lettered;
2. with ``--corpus`` (served by ``/work/shared/corpus/serve start``): a reference crawl of
   the corpus without faults, then the same crawl again with random service kills and
   server restarts; the second must store exactly the first's URL set.

Checks (:meth:`tests.integration.chaoscrawl.CrawlReport.problems`): result URL set = the
reachable (reference) set, no URL twice, exactly one completion event per job, dead
letters only for the two poison pages, each with its reason. Exit status 1 on a problem.

Run::

    PYTHONPATH=. python tests/benchmarks/chaos.py --pages 3000 --corpus
    PYTHONPATH=. python tests/benchmarks/chaos.py --seed 1234     # replay a run
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from shared.contracts import CrawlRequest
from shared.launcher import SERVICES
from shared.streams import FRONTIER
from tests.graphsite import GraphSite
from tests.integration.chaoscrawl import CrawlReport, crawl_under_faults, until, until_async
from tests.integration.chaosmesh import ChaosMesh
from tests.sites import html

CORPUS = Path("/work/shared/corpus/serve")


class PoisonPage:
    """``/poison``: each request hangs until released (after its fetcher was killed)."""

    def __init__(self) -> None:
        self.held: list[threading.Event] = []

    def hanging(self) -> bool:
        return any(not event.is_set() for event in self.held)

    def release_all(self) -> None:
        for event in self.held:
            event.set()

    def __call__(self, handler: BaseHTTPRequestHandler) -> None:
        release = threading.Event()
        self.held.append(release)
        release.wait(600)
        body = html("poison")
        try:
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        except OSError:  # the fetcher is gone
            pass


class Chaos:
    """Random faults on ``mesh`` until the job is done (see module docstring)."""

    def __init__(self, mesh: ChaosMesh, rng: random.Random, every_s: float,
                 server_restarts: int, retire: bool) -> None:
        self.mesh = mesh
        self.rng = rng
        self.every_s = every_s
        self.server_restarts = server_restarts
        self.to_retire = list(SERVICES) if retire else []
        self.started = time.monotonic()

    def say(self, what: str) -> None:
        print(f"  {time.monotonic() - self.started:7.1f} s  {what}", flush=True)

    async def run(self, done: Callable[[], bool], stop: Callable[[], bool]) -> None:
        """Strike until ``done()`` (job ended) or ``stop()`` (the caller's phase is over)."""
        while not done() and not stop():
            await asyncio.sleep(self.rng.expovariate(1 / self.every_s))  # pacing, not a check
            if done() or stop():
                return
            roll = self.rng.random()
            if self.to_retire and roll < 0.25:
                kind = self.to_retire.pop(self.rng.randrange(len(self.to_retire)))
                name = await asyncio.to_thread(self.mesh.retire, kind)
                self.say(f"SIGKILL {name} for good")
            elif self.server_restarts and roll < 0.4:
                self.server_restarts -= 1
                down_s = self.rng.uniform(2.0, 6.0)
                self.say(f"SIGKILL nats-server, down {down_s:.1f} s")
                await asyncio.to_thread(self.mesh.restart_server, down_s)
                self.say("nats-server started again")
            else:
                kind = self.rng.choice(SERVICES)
                pid = await asyncio.to_thread(self.mesh.kill, kind)
                self.say(f"SIGKILL {kind} (pid {pid})")


async def kill_poison_holders(mesh: ChaosMesh, poison: PoisonPage,
                              done: Callable[[], bool]) -> int:
    """SIGKILL the fetcher holding ``/poison`` each time it is fetched, once it is the only
    frontier entry left (so no healthy entry shares its deliveries), until the job ends."""
    nc = await mesh.connect_mesh()
    kills = 0

    async def only_poison_left() -> bool:
        return (await nc.jetstream().stream_info(FRONTIER.name)).state.messages <= 1

    try:
        while await until(poison.hanging, done, timeout_s=600):
            await until_async(only_poison_left, timeout_s=600)
            # With one fetcher replica left (the other retired), it is the holder.
            pid = await asyncio.to_thread(mesh.kill, "fetcher")
            kills += 1
            print(f"  SIGKILL fetcher (pid {pid}) holding /poison, request {len(poison.held)}",
                  flush=True)
            poison.release_all()
    finally:
        poison.release_all()
        await nc.close()
    return kills


def figures(name: str, report: CrawlReport, expected: set[str],
            poison: dict[str, str]) -> list[str]:
    problems = report.problems(expected, poison)
    print(f"\n{name}: {report.summary()}")
    print(f"  pages crawled {len(report.urls)} of {len(expected)} expected; duplicates "
          f"{report.duplicates}; losses {len(report.lost(expected))}; completion events "
          f"{report.completions}; dead letters {len(report.letters)}; wall {report.wall_s:.1f} s")
    for letter in report.letters:
        print(f"  dead letter {letter.id} stage {letter.stage} delivery {letter.delivery_count}: "
              f"{letter.reason}")
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    return problems


async def generated_phase(mesh: ChaosMesh, args: argparse.Namespace,
                          rng: random.Random) -> list[str]:
    poison = PoisonPage()
    site = GraphSite(args.pages, hosts=args.hosts, seed=args.seed)
    site.start(routes={"/poison": poison})
    try:
        poison_url = site.add_leaf("/poison", rng.randrange(1, 50), own_host=True)
        crash_url = site.add_leaf("/crash", rng.randrange(1, 50), body=html("crash"))
        expected = site.reachable()
        print(f"\ngenerated site: {args.pages} pages on {args.hosts} hosts, "
              f"{len(expected)} reachable URLs (poison {poison_url}, crash {crash_url})")
        chaos = Chaos(mesh, rng, args.every, args.server_restarts, retire=True)

        async def faults(done: Callable[[], bool]) -> None:
            # Random faults while the bulk is crawled, then the last-delivery kills.
            bulk = int(len(expected) * 0.85)
            await chaos.run(done, lambda: site.requests >= bulk)
            while chaos.to_retire and not done():  # every kind loses a replica for good
                name = await asyncio.to_thread(mesh.retire, chaos.to_retire.pop())
                chaos.say(f"SIGKILL {name} for good")
            await kill_poison_holders(mesh, poison, done)

        report = await crawl_under_faults(mesh, site.request(), faults, args.timeout)
        return figures("generated site", report, expected,
                       {poison_url: "max deliveries", crash_url: "injected fault"})
    finally:
        poison.release_all()
        site.stop()


async def corpus_phase(mesh: ChaosMesh, args: argparse.Namespace, rng: random.Random,
                       seeds: list[str]) -> list[str]:
    request = CrawlRequest(seeds=tuple(seeds), max_depth=100, max_pages=10_000)

    async def no_faults(done: Callable[[], bool]) -> None:
        return None

    print(f"\ncorpus {seeds}: reference crawl without faults")
    reference = await crawl_under_faults(mesh, request, no_faults, args.timeout)
    problems = figures("corpus reference", reference, set(reference.urls), {})
    print("corpus crawl with random kills and nats-server restarts")
    chaos = Chaos(mesh, rng, args.every, args.server_restarts, retire=False)

    async def faults(done: Callable[[], bool]) -> None:
        await chaos.run(done, lambda: False)

    report = await crawl_under_faults(mesh, request, faults, args.timeout)
    return problems + figures("corpus under chaos", report, set(reference.urls), {})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="Replay this run's faults.")
    parser.add_argument("--pages", type=int, default=3000)
    parser.add_argument("--hosts", type=int, default=6)
    parser.add_argument("--every", type=float, default=4.0,
                        help="Mean seconds between two random faults.")
    parser.add_argument("--server-restarts", type=int, default=3,
                        help="nats-server SIGKILLs per crawl.")
    parser.add_argument("--corpus", action="store_true", help="Also crawl the corpus.")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Per crawl, seconds.")
    parser.add_argument("--keep", action="store_true", help="Keep the mesh home (logs).")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    command = " ".join(["PYTHONPATH=. python tests/benchmarks/chaos.py", *sys.argv[1:]])
    if "--seed" not in sys.argv:
        command += f" --seed {args.seed}"
    print(f"seed {args.seed}; replay: {command}", flush=True)
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="crawlmesh-chaos-"))
    started = time.monotonic()
    mesh = ChaosMesh(home, rng=rng, replicas=dict.fromkeys(SERVICES, 2), env={
        "CRAWLMESH_FAULT_INJECT": 'parser:/crash"',
        "CRAWLMESH_FETCHER_READ_TIMEOUT_S": "600",
        "CRAWLMESH_FETCHER_TOTAL_TIMEOUT_S": "600",
        "CRAWLMESH_FETCHER_HOST_RULES": '{"127.0.*": {"delay_s": 0, "max_in_flight": 4}}',
    })
    problems: list[str] = []
    try:
        mesh.start()
        problems += asyncio.run(generated_phase(mesh, args, rng))
        if args.corpus:
            seeds = subprocess.run([str(CORPUS), "start"], capture_output=True, text=True,
                                   check=True).stdout.split()
            problems += asyncio.run(corpus_phase(mesh, args, rng, seeds))
    finally:
        mesh.stop()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    kills = collections.Counter(mesh.kills)
    print(f"\nkills survived: {dict(sorted(kills.items()))} (total {sum(kills.values())})")
    print(f"seed {args.seed}; wall {time.monotonic() - started:.1f} s; command: {command}")
    print("RESULT: " + ("all promises kept" if not problems else f"{len(problems)} problems"))
    if args.keep:
        print(f"mesh home (logs): {home}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
