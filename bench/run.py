"""crawlmesh against Scrapy and a bare asyncio loop on the corpus, side by side (issue 10).

In one run, crawls the corpus (``../shared/corpus``, served by ``serve start``) with

- **scrapy**: ``bench/scrapy_spider.py`` (the reference ``CrawlSpider``), its own process;
- **bare**: ``bench/bare_loop.py`` (httpx + parsel + a set: the CPU floor), its own process;
- **crawlmesh**: ``crawlmesh up`` in a fresh home (embedded nats-server with JetStream
  file storage, the launcher and the five services), politeness lifted for the corpus
  hosts only (``CRAWLMESH_FETCHER_HOST_DELAYS='{"127.0.0.*": 0}'``, as in the README's
  quick start), robots.txt on, tracing on with no exporter (no ``OTEL_*`` variables), one
  job over the three seeds with ``--max-depth 100``, submitted and followed by this process
  as the ``default`` tenant;

each ``--runs`` times, interleaved (scrapy, bare, crawlmesh, scrapy, ...), and prints the
medians side by side. What is measured:

- **wall**: the crawl itself: Scrapy's spider open to close; the bare loop's first to last
  request; crawlmesh's submission to its ``completed`` event (mesh start and stop excluded,
  shown apart as ``mesh start``).
- **CPU per page**: CPU seconds over that same window, divided by the pages crawled. For
  crawlmesh, of every counted process: nats-server, the launcher and every service process
  (a restarted one counts too), sampled every 0.2 s and read once more at the end; the
  corpus web server and this harness (the tenant reading its results) are not counted.
- **peak RSS**: per process (the kernel's high-water mark, ``VmHWM``, and samples) and the
  peak of the sampled total of the counted processes (RSS, not USS).
- **first result**: seed to first result: Scrapy's first item after spider open, the bare
  loop's first parsed page, crawlmesh's first result in the tenant's ``RESULTS`` stream
  after submission.
- **pages**: responses (every status). crawlmesh's result URLs must be unique and match
  Scrapy's set of URLs; the differences are printed.

Reproduce (the corpus server first)::

    ../shared/corpus/serve start
    . .venv/bin/activate && PYTHONPATH=. python bench/run.py --runs 3

``--quick`` (or ``--max-pages N``) makes a small smoke run; ``--only`` picks crawlers;
``--profile DIR`` adds one more crawlmesh run, not counted, during which py-spy records
every service process (see ``bench/profile_summary.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from nats.js.api import ConsumerConfig, DeliverPolicy

from bench.meter import TreeMeter, cpu_between, rss_peaks, wait_for
from shared import subjects
from shared.cli.jobs import open_session, results_subject, submit, wait_for_job
from shared.contracts import CrawlRequest, ExtractionRule, JobEventKind, Scope, ScopeMode
from shared.launcher import SERVICES
from shared.settings import MeshSettings
from shared.streams import RESULTS
from shared.urls import UrlError, canonical_url

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
CORPUS_SERVE = REPO.parent / "shared" / "corpus" / "serve"
CRAWLERS = ("scrapy", "bare", "crawlmesh")
HOST_DELAYS = '{"127.0.0.*": 0}'
"""Politeness lifted for the corpus' loopback hosts only (as the README's quick start)."""
BODY_TEXT_RULE = ExtractionRule(name="body_text", xpath="//body")
"""The body text, extracted by crawlmesh's parser as Scrapy's spider does."""


@dataclass
class RunResult:
    """One crawl by one crawler."""

    crawler: str
    wall_s: float
    cpu_s: float
    pages: int
    first_result_s: float | None
    rss_peak_by_process: dict[str, int]
    rss_peak_total_bytes: int
    statuses: dict[str, int]
    cpu_by_process: dict[str, float] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)
    unique_urls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pages_per_s(self) -> float:
        return self.pages / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_ms_per_page(self) -> float:
        return 1000 * self.cpu_s / self.pages if self.pages else 0.0


def seeds() -> list[str]:
    """The corpus seeds (``serve seeds``)."""
    out = subprocess.run([str(CORPUS_SERVE), "seeds"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are all free now."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def ready(url: str) -> bool:
    """True if ``url`` answers 200 (a service's ``/readyz``)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


# ---- Scrapy and the bare loop: one child process each --------------------------------------


def run_child(crawler: str, seed_urls: list[str], max_pages: int, workdir: Path) -> RunResult:
    """Run ``bench/<crawler>`` in its own process, metered; read its JSON summary."""
    script = {"scrapy": "scrapy_spider.py", "bare": "bare_loop.py"}[crawler]
    summary_path = workdir / f"{crawler}.json"
    command = [sys.executable, str(BENCH / script), "--summary", str(summary_path), *seed_urls]
    if max_pages:
        command += ["--max-pages", str(max_pages)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with (workdir / f"{crawler}.log").open("wb") as log:
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    meter = TreeMeter([child.pid]).start()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    meter.stop()
    if child.returncode != 0:
        raise RuntimeError(f"{crawler} exited {child.returncode}: see {workdir / (crawler + '.log')}")
    summary = json.loads(summary_path.read_text())
    peak = max(usage.ru_maxrss * 1024, meter.total_rss_peak_bytes)  # ru_maxrss is in KiB
    return RunResult(
        crawler=crawler, wall_s=summary["wall_s"], cpu_s=summary["cpu_s"],
        pages=summary["pages"], first_result_s=summary["first_result_s"],
        rss_peak_by_process={crawler: peak}, rss_peak_total_bytes=peak,
        statuses=summary["statuses"], cpu_by_process={crawler: summary["cpu_s"]},
        urls=summary["urls"], unique_urls=summary["unique_urls"],
        extra={"process_cpu_s": usage.ru_utime + usage.ru_stime,
               "duplicates_filtered": summary.get("duplicates_filtered")},
    )


# ---- crawlmesh: the embedded mesh, one job ---------------------------------------------------


def mesh_env(home: Path, nats_url: str, metrics_base_port: int) -> dict[str, str]:
    """The environment of ``crawlmesh up``: a fresh home, free ports, corpus politeness,
    tracing on without an exporter."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "CRAWLMESH_"))}
    env.update({
        "CRAWLMESH_HOME": str(home),
        "CRAWLMESH_NATS_URL": nats_url,
        # free ports (other meshes on this machine use 9460..); /readyz tells when it is up
        "CRAWLMESH_METRICS_BASE_PORT": str(metrics_base_port),
        "CRAWLMESH_FETCHER_HOST_DELAYS": HOST_DELAYS,
        "PYTHONPATH": str(REPO),
    })
    return env


@dataclass
class ResultReader:
    """Reads the job's results from the tenant's ``RESULTS`` as they arrive."""

    urls: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    first_at: float = 0.0

    def take(self, payload: bytes) -> None:
        if not self.first_at:
            self.first_at = time.monotonic()
        result = orjson.loads(payload)
        self.urls.append(result["url"])
        self.outcomes[result["outcome"]] += 1
        self.statuses[str(result.get("status") or 0)] += 1


async def crawl_mesh(settings: MeshSettings, seed_urls: list[str], max_pages: int,
                     meter: TreeMeter) -> tuple[RunResult, dict[str, Any]]:
    """Submit one job as the default tenant, follow it to completion, read its results."""
    request = CrawlRequest(seeds=tuple(seed_urls), job_id=subjects.new_job_id(),
                           max_depth=100, max_pages=max_pages or 10_000,
                           scope=Scope(mode=ScopeMode.SAME_HOST), rules=(BODY_TEXT_RULE,))
    assert request.job_id is not None
    reader = ResultReader()
    async with open_session(settings, None, "default") as session:
        tjs = session.tenant.jetstream()
        sub = await tjs.pull_subscribe(
            results_subject(request.job_id), durable=None, stream=RESULTS,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy="none",
                                  inactive_threshold=120.0, max_ack_pending=-1))
        done = asyncio.Event()

        async def read() -> None:
            while True:
                try:
                    msgs = await sub.fetch(256, timeout=0.5)
                except TimeoutError:
                    if done.is_set():
                        return
                    continue
                for msg in msgs:
                    reader.take(msg.data)

        before = meter.snapshot()
        started = time.monotonic()
        reading = asyncio.create_task(read())
        job = await submit(session.tenant, request, timeout_s=120)
        event = await wait_for_job(session.tenant, job, show=False)
        ended = time.monotonic()
        after = meter.snapshot()
        done.set()
        await reading
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if event.kind is not JobEventKind.COMPLETED:
        raise RuntimeError(f"job {job} ended {event.kind}: {event.reason}")
    cpu = cpu_between(before, after)
    counters = event.counters.model_dump() if event.counters else {}
    result = RunResult(
        crawler="crawlmesh", wall_s=ended - started, cpu_s=sum(cpu.values()),
        pages=len(reader.urls),
        first_result_s=reader.first_at - started if reader.first_at else None,
        rss_peak_by_process=rss_peaks(after), rss_peak_total_bytes=meter.total_rss_peak_bytes,
        statuses=dict(sorted(reader.statuses.items())), cpu_by_process=cpu,
        urls=sorted(reader.urls), unique_urls=len(set(reader.urls)),
        extra={"outcomes": dict(reader.outcomes), "counters": counters, "job": job,
               "processes": len(after)},
    )
    return result, {"before": before, "after": after}


def start_mesh(home: Path) -> tuple[subprocess.Popen[bytes], MeshSettings, float]:
    """``crawlmesh up`` in ``home``, every service ready (``/readyz``); returns it, its
    settings and how long it took to start."""
    nats_url = f"nats://127.0.0.1:{free_port()}"
    env = mesh_env(home, nats_url, free_port_run(len(SERVICES)))
    started = time.monotonic()
    with (home.parent / "launcher.log").open("wb") as log:
        launcher = subprocess.Popen([sys.executable, "-m", "shared.cli.main", "up"], env=env,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def up() -> bool:
        if launcher.poll() is not None:
            raise RuntimeError(f"crawlmesh up exited {launcher.returncode}: "
                               f"see {home.parent / 'launcher.log'}")
        return (home / "mesh.json").exists()

    wait_for(up, 120, "crawlmesh up did not start")
    endpoints = json.loads((home / "mesh.json").read_text())["metrics"]
    for name, url in endpoints.items():
        wait_for(lambda url=url: ready(f"{url}/readyz"), 120, f"{name} was not ready")
    settings = MeshSettings(home=home, nats_url=nats_url)
    return launcher, settings, time.monotonic() - started


def stop_mesh(launcher: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher (it stops the services, then nats-server) and wait."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    try:
        launcher.wait(90)
    except subprocess.TimeoutExpired:
        launcher.kill()
        launcher.wait()


def service_pids(launcher_pid: int) -> dict[str, int]:
    """``{role: pid}`` of the mesh's processes (one per service, and nats-server)."""
    import psutil

    from bench.meter import role_of

    root = psutil.Process(launcher_pid)
    return {role_of(p): p.pid for p in root.children(recursive=True)}


def run_mesh(seed_urls: list[str], max_pages: int, workdir: Path,
             profile: Path | None = None) -> RunResult:
    """Start a fresh embedded mesh, crawl the corpus once, stop it (see module docstring).

    With ``profile``, every service process is recorded by ``py-spy record`` during the
    crawl (raw collapsed stacks in ``profile/<service>.txt``).
    """
    home = workdir / "mesh" / "home"
    home.mkdir(parents=True)
    launcher, settings, start_s = start_mesh(home)
    spies: list[subprocess.Popen[bytes]] = []
    try:
        meter = TreeMeter([launcher.pid]).start()
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
            for role, pid in service_pids(launcher.pid).items():
                if role == "nats-server":
                    continue
                spies.append(subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pid), "--rate", "100", "--format", "raw",
                     "--nonblocking", "--output", str(profile / f"{role}.txt")],
                    stdout=subprocess.DEVNULL, stderr=(profile / f"{role}.log").open("wb")))
        try:
            result, _ = asyncio.run(crawl_mesh(settings, seed_urls, max_pages, meter))
        finally:
            for spy in spies:
                spy.send_signal(signal.SIGINT)
            for spy in spies:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spy.wait(60)
            meter.stop()
    finally:
        stop_mesh(launcher)
    result.extra["mesh_start_s"] = start_s
    result.extra["restarts"] = _restarts(home)
    return result


def _restarts(home: Path) -> int:
    """How many service restarts the launcher logged."""
    log = home.parent / "launcher.log"
    return log.read_text(errors="replace").count("restarted ") if log.exists() else 0


# ---- the table --------------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def mib(value: float) -> str:
    return f"{value / (1 << 20):,.0f}"


def summarise(results: dict[str, list[RunResult]]) -> dict[str, dict[str, float]]:
    """Medians per crawler."""
    table: dict[str, dict[str, float]] = {}
    for crawler, runs in results.items():
        if not runs:
            continue
        table[crawler] = {
            "wall_s": median([r.wall_s for r in runs]),
            "pages_per_s": median([r.pages_per_s for r in runs]),
            "cpu_ms_per_page": median([r.cpu_ms_per_page for r in runs]),
            "cpu_s": median([r.cpu_s for r in runs]),
            "rss_peak_total_bytes": median([float(r.rss_peak_total_bytes) for r in runs]),
            "first_result_s": median([r.first_result_s or 0.0 for r in runs]),
            "pages": median([float(r.pages) for r in runs]),
        }
    return table


ROWS = (
    ("wall (s)", "wall_s", "{:.1f}"),
    ("pages/s", "pages_per_s", "{:.1f}"),
    ("CPU s (all counted processes)", "cpu_s", "{:.1f}"),
    ("CPU ms per page", "cpu_ms_per_page", "{:.1f}"),
    ("peak RSS total (MiB)", "rss_peak_total_bytes", "mib"),
    ("seed to first result (s)", "first_result_s", "{:.2f}"),
    ("pages crawled", "pages", "{:,.0f}"),
)


def markdown_table(table: dict[str, dict[str, float]]) -> str:
    """The medians as a Markdown table with the ratios crawlmesh/Scrapy and crawlmesh/bare."""
    crawlers = [c for c in CRAWLERS if c in table]
    mesh = table.get("crawlmesh")
    header = ["", *crawlers]
    if mesh and "scrapy" in table:
        header.append("crawlmesh / scrapy")
    if mesh and "bare" in table:
        header.append("crawlmesh / bare")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, key, fmt in ROWS:
        cells = [label]
        for crawler in crawlers:
            value = table[crawler][key]
            cells.append(mib(value) if fmt == "mib" else fmt.format(value))
        for other in ("scrapy", "bare"):
            if mesh and other in table:
                base = table[other][key]
                cells.append(f"{mesh[key] / base:.2f}x" if base else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_process_table(results: dict[str, list[RunResult]]) -> str:
    """crawlmesh's median CPU seconds and peak RSS per process role."""
    runs = results.get("crawlmesh") or []
    if not runs:
        return ""
    roles = sorted({role for r in runs for role in r.cpu_by_process})
    lines = ["| crawlmesh process | CPU s (crawl) | CPU ms per page | peak RSS (MiB) |",
             "|---|---|---|---|"]
    for role in roles:
        cpu = median([r.cpu_by_process.get(role, 0.0) for r in runs])
        per_page = median([1000 * r.cpu_by_process.get(role, 0.0) / r.pages for r in runs])
        rss = median([float(r.rss_peak_by_process.get(role, 0)) for r in runs])
        lines.append(f"| {role} | {cpu:.1f} | {per_page:.1f} | {mib(rss)} |")
    return "\n".join(lines)


def canonical_set(urls: list[str]) -> set[str]:
    """The canonical forms (:func:`shared.urls.canonical_url`: fragment dropped) of ``urls``;
    Scrapy requests keep the fragment of the link they came from."""
    out: set[str] = set()
    for url in urls:
        with contextlib.suppress(UrlError):
            out.add(canonical_url(url))
    return out


def check_pages(results: dict[str, list[RunResult]]) -> list[str]:
    """Every page exactly once: crawlmesh's result URLs unique and equal to Scrapy's set."""
    notes: list[str] = []
    reference = canonical_set(results["scrapy"][0].urls) if results.get("scrapy") else None
    for index, run in enumerate(results.get("crawlmesh") or [], 1):
        duplicates = len(run.urls) - run.unique_urls
        note = f"crawlmesh run {index}: {len(run.urls)} results, {duplicates} duplicate URLs"
        if reference is not None:
            mine = canonical_set(run.urls)
            only_mesh, only_scrapy = sorted(mine - reference), sorted(reference - mine)
            note += (f"; {len(only_mesh)} URLs only crawlmesh has {only_mesh[:5]}, "
                     f"{len(only_scrapy)} only Scrapy has {only_scrapy[:5]}")
        notes.append(note)
    return notes


def machine() -> str:
    """nproc, CPU model, RAM, Python and nats-server versions."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import psutil

    nats = subprocess.run(["nats-server", "--version"], capture_output=True, text=True).stdout
    return (f"{os.cpu_count()} cores ({model}), {psutil.virtual_memory().total / (1 << 30):.1f} GiB "
            f"RAM, Python {platform.python_version()}, {nats.strip() or 'nats-server ?'}, "
            f"load average at start {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="crawls per crawler (medians)")
    parser.add_argument("--max-pages", type=int, default=0, help="cap pages (smoke runs)")
    parser.add_argument("--quick", action="store_true", help="one run of 200 pages each")
    parser.add_argument("--only", default=",".join(CRAWLERS), help="crawlers, comma-separated")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("--profile", type=Path, help="py-spy each crawlmesh service into DIR")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.max_pages = 1, args.max_pages or 200
    crawlers = [c for c in CRAWLERS if c in args.only.split(",")]
    seed_urls = seeds()
    print(f"machine: {machine()}", flush=True)
    results: dict[str, list[RunResult]] = {c: [] for c in crawlers}
    work = Path(tempfile.mkdtemp(prefix="crawlmesh-bench-"))
    try:
        for index in range(args.runs):
            for crawler in crawlers:
                folder = work / f"{crawler}-{index}"
                folder.mkdir()
                if crawler == "crawlmesh":
                    run = run_mesh(seed_urls, args.max_pages, folder)
                else:
                    run = run_child(crawler, seed_urls, args.max_pages, folder)
                results[crawler].append(run)
                if args.json:  # one line per run as it ends, so a cut-short run keeps its figures
                    with args.json.with_suffix(".runs.jsonl").open("a") as runs_log:
                        runs_log.write(json.dumps({**run.__dict__, "urls": None, "run": index + 1},
                                                  default=str) + "\n")
                print(f"run {index + 1} {crawler}: {run.pages} pages in {run.wall_s:.1f} s, "
                      f"{run.pages_per_s:.1f} pages/s, {run.cpu_ms_per_page:.1f} CPU ms/page, "
                      f"peak RSS {mib(run.rss_peak_total_bytes)} MiB, first result "
                      f"{run.first_result_s or 0:.2f} s, statuses {run.statuses}"
                      + (f", mesh start {run.extra['mesh_start_s']:.1f} s, restarts "
                         f"{run.extra['restarts']}, CPU s by process "
                         + ", ".join(f"{k} {v:.1f}" for k, v in sorted(run.cpu_by_process.items()))
                         + ", peak RSS MiB by process "
                         + ", ".join(f"{k} {mib(v)}"
                                     for k, v in sorted(run.rss_peak_by_process.items()))
                         if crawler == "crawlmesh" else ""), flush=True)
        if args.profile is not None:  # an extra run, not counted: py-spy costs CPU
            folder = work / "profiled"
            folder.mkdir()
            run = run_mesh(seed_urls, args.max_pages, folder, args.profile)
            print(f"profiled crawlmesh run (not counted): {run.pages} pages in {run.wall_s:.1f} s, "
                  f"CPU s by process {run.cpu_by_process}; py-spy output in {args.profile}",
                  flush=True)
    finally:
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    table = summarise(results)
    print(f"\nmedians of {args.runs} run(s):\n")
    print(markdown_table(table))
    if per_process := per_process_table(results):
        print("\n" + per_process)
    for note in check_pages(results):
        print(note)
    command = "PYTHONPATH=. python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\nreproduce: ../shared/corpus/serve start && . .venv/bin/activate && {command.strip()}")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": machine(), "command": command, "medians": table,
            "runs": {c: [{**r.__dict__, "urls": None} for r in runs] for c, runs in results.items()},
        }, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
