"""The real ``crawlmesh`` command (``crawl``, ``status``, ``cancel``, ``results``) against an
embedded mesh (``crawlmesh up`` as a child process) crawling loopback sites.

One mesh serves the whole module. The ``slow`` site has a host delay of 0.5 s and a page
(``/hold``) that answers only when the test lets it, so its crawl is surely still running
when it is cancelled; the ``quick`` site is crawled with no delay.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import orjson
import pytest

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.settings import MeshSettings
from shared.streams import MESH_STREAMS
from shared.tenancy import DEFAULT_TENANT
from tests.integration.meshproc import MeshProcess
from tests.sites import Site, html, wait_for

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
QUICK_PAGES = ("/", "/a", "/b", "/c")


@dataclass
class Sites:
    quick: Site
    slow: Site
    release: threading.Event


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def sites() -> Iterator[Sites]:
    release = threading.Event()

    def hold(handler: BaseHTTPRequestHandler) -> None:
        release.wait(30)
        body = html('<a href="/after-cancel">after</a>', "Held")
        handler.send_response(200)
        handler.send_header("Content-Type", "text/html")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    quick = Site()
    quick.pages = {
        "/": (200, "text/html", html('<a href="/a">a</a> <a href="/b">b</a>', "Home")),
        "/a": (200, "text/html", html('<a href="/c">c</a> <a href="/">home</a>', "A")),
        "/b": (200, "text/html", html("leaf", "B")),
        "/c": (200, "text/html", html("leaf", "C")),
    }
    slow = Site()
    slow.pages = {"/": (200, "text/html", html(
        '<a href="/hold">hold</a>' + "".join(f'<a href="/s{i}">s</a>' for i in range(4)), "Slow"))}
    slow.pages.update({f"/s{i}": (200, "text/html", html("leaf", f"S{i}")) for i in range(4)})
    slow.routes = {"/hold": hold}
    quick.start()
    slow.start()
    try:
        yield Sites(quick, slow, release)
    finally:
        release.set()
        quick.stop()
        slow.stop()


@pytest.fixture(scope="module")
def mesh(sites: Sites, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshProcess]:
    slow_host = f"127.0.0.1:{sites.slow.base.rsplit(':', 1)[1]}"
    delays = json.dumps({slow_host: 0.5, "127.0.0.*": 0})
    with pytest.MonkeyPatch.context() as patch:  # no CRAWLMESH_* of the caller's shell
        for name in list(os.environ):
            if name.startswith("CRAWLMESH_"):
                patch.delenv(name)
        process = MeshProcess(tmp_path_factory.mktemp("cli") / "home",
                              env={"CRAWLMESH_FETCHER_HOST_DELAYS": delays}).start()
    try:
        yield process
    finally:
        sites.release.set()
        assert process.stop() == 0, process.log("launcher")


def crawlmesh(mesh: MeshProcess, *args: str, timeout_s: float = 60) -> Run:
    """Run the ``crawlmesh`` command with the mesh's environment."""
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", *args], cwd=REPO_ROOT,
        env={**mesh.env, "COLUMNS": "200"}, capture_output=True, timeout=timeout_s,
    )
    return Run(done.returncode, done.stdout.decode(), done.stderr.decode())


def status_of(mesh: MeshProcess, job: str) -> dict:
    run = crawlmesh(mesh, "status", job)
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    return json.loads(line)


@dataclass
class Completed:
    job: str
    run: Run
    output: Path


@pytest.fixture(scope="module")
def completed(mesh: MeshProcess, sites: Sites, tmp_path_factory: pytest.TempPathFactory) -> Completed:
    """``crawl --wait --output FILE`` of the quick site, run once for the module."""
    output = tmp_path_factory.mktemp("out") / "results.jsonl"
    run = crawlmesh(mesh, "crawl", "--wait", "--output", str(output), sites.quick.url("/"))
    job = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    return Completed(job, run, output)


def test_crawl_wait_exits_0_and_writes_one_json_line_per_page(
    completed: Completed, sites: Sites,
) -> None:
    assert completed.run.returncode == 0, completed.run.stderr
    assert f"job {completed.job} completed: 4 pages finished (0 failed) of 4 admitted" \
        in completed.run.stderr
    assert f"4 results written to {completed.output}" in completed.run.stderr
    lines = completed.output.read_bytes().splitlines()
    results = [orjson.loads(line) for line in lines]
    assert sorted(r["url"] for r in results) == sorted(sites.quick.url(p) for p in QUICK_PAGES)
    assert {r["job_id"] for r in results} == {completed.job}
    assert {r["outcome"] for r in results} == {"ok"}
    assert {r["title"] for r in results} == {"Home", "A", "B", "C"}


def test_status_shows_the_completed_job_with_its_counters(
    completed: Completed, mesh: MeshProcess, sites: Sites,
) -> None:
    shown = status_of(mesh, completed.job)
    assert shown["job_id"] == completed.job
    assert shown["state"] == "completed"
    assert (shown["admitted"], shown["finished"], shown["failed"], shown["seeded"]) == \
        (4, 4, 0, True)
    assert shown["seeds"] == [sites.quick.url("/")]
    assert shown["finished_at"] is not None

    listing = crawlmesh(mesh, "status")
    assert listing.returncode == 0, listing.stderr
    assert completed.job in {json.loads(line)["job_id"] for line in listing.stdout.splitlines()}


def test_results_prints_the_results_of_a_job(completed: Completed, mesh: MeshProcess) -> None:
    run = crawlmesh(mesh, "results", completed.job)
    assert run.returncode == 0, run.stderr
    printed = sorted(orjson.loads(line)["url"] for line in run.stdout.splitlines())
    written = sorted(orjson.loads(line)["url"] for line in completed.output.read_bytes().splitlines())
    assert printed == written and len(printed) == len(QUICK_PAGES)
    assert "4 results" in run.stderr


def test_an_invalid_seed_exits_non_zero_naming_the_scheme(mesh: MeshProcess) -> None:
    run = crawlmesh(mesh, "crawl", "ftp://x")
    assert run.returncode != 0
    assert "invalid crawl request" in run.stderr
    assert "unsupported scheme 'ftp'" in run.stderr


def test_error_text_is_shown_verbatim_not_as_markup(mesh: MeshProcess) -> None:
    run = crawlmesh(mesh, "crawl", "ftp://x/[/x]")
    assert run.returncode == 2, run.stderr
    assert "MarkupError" not in run.stderr
    assert "ftp://x/[/x]" in run.stderr


def test_status_of_an_unknown_job_exits_1(mesh: MeshProcess) -> None:
    run = crawlmesh(mesh, "status", "nosuchjob")
    assert run.returncode == 1
    assert "no job 'nosuchjob'" in run.stderr


async def _drained(settings: MeshSettings) -> bool:
    """True when no work-queue stream of the mesh holds a message (no work in flight)."""
    nc = await connect(settings, "test-cli")
    try:
        js = nc.jetstream()
        for spec in MESH_STREAMS:
            if spec.work_queue and (await js.stream_info(spec.name)).state.messages:
                return False
        return True
    finally:
        await nc.close()


def test_completed_crawl_wait_printed_progress_lines(completed: Completed) -> None:
    """Not a terminal: plain lines (the final state at least), no bar."""
    assert f"job {completed.job}: 4 done, 0 queued, 0 failed" in completed.run.stderr


def test_status_follow_of_an_ended_job_prints_its_status_at_once(
    completed: Completed, mesh: MeshProcess,
) -> None:
    run = crawlmesh(mesh, "status", completed.job, "--follow")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["state"] == "completed"
    assert crawlmesh(mesh, "status", "--follow").returncode == 2  # which job?


def test_cancel_stops_a_running_crawl(mesh: MeshProcess, sites: Sites, tmp_path: Path) -> None:
    submitted = crawlmesh(mesh, "crawl", sites.slow.url("/"))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    assert f"job {job} accepted" in submitted.stderr

    wait_for(lambda: "/hold" in sites.slow.requests, 30, "the crawl to reach /hold")
    assert status_of(mesh, job)["state"] == "running"
    progress = tmp_path / "follow.err"
    with progress.open("wb") as stderr:
        follow = subprocess.Popen(
            [sys.executable, "-m", "shared.cli.main", "status", job, "--follow"],
            cwd=REPO_ROOT, env=mesh.env, stdout=subprocess.PIPE, stderr=stderr)
    try:
        wait_for(lambda: f"job {job}: " in progress.read_text(), 30, "status --follow to show progress")
        cancelled = crawlmesh(mesh, "cancel", job)
        assert cancelled.returncode == 0, cancelled.stderr
        assert f"job {job} cancelled" in cancelled.stderr
        followed, _ = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 0, progress.read_text()
    assert json.loads(followed)["state"] == "cancelled"
    assert " queued, 0 failed" in progress.read_text()
    sites.release.set()

    shown = status_of(mesh, job)
    assert shown["state"] == "cancelled"
    assert shown["finished_at"] is not None
    again = crawlmesh(mesh, "cancel", job)
    assert again.returncode == 0 and f"job {job} was not running" in again.stderr

    # The pages in flight at the cancel finish without completing the job.
    wait_for(lambda: asyncio.run(_drained(mesh.settings)), 30, "the mesh to go idle")
    assert status_of(mesh, job)["state"] == "cancelled"


def test_tenant_side_commands_with_a_creds_file(mesh: MeshProcess, sites: Sites) -> None:
    """``submit``/``status``/``results`` with only the default tenant's creds file (what a
    tenant is given), reading its own EVENTS and RESULTS."""
    creds = str(KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT))
    submitted = crawlmesh(mesh, "submit", "--creds", creds, "--wait", "--max-depth", "1",
                          sites.quick.url("/"))
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    assert f"job {job} accepted" in submitted.stderr
    assert f"job {job} completed: 3 pages finished (0 failed) of 3 admitted" in submitted.stderr

    status = crawlmesh(mesh, "status", "--creds", creds, job)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert (shown["job_id"], shown["state"], shown["admitted"], shown["finished"]) == \
        (job, "completed", 3, 3)
    listing = crawlmesh(mesh, "status", "--creds", creds)
    assert job in {json.loads(line)["job_id"] for line in listing.stdout.splitlines()}

    results = crawlmesh(mesh, "results", "--creds", creds, job, "--follow")
    assert results.returncode == 0, results.stderr
    urls = sorted(orjson.loads(line)["url"] for line in results.stdout.splitlines())
    assert urls == sorted(sites.quick.url(p) for p in ("/", "/a", "/b"))

    unknown = crawlmesh(mesh, "results", "--creds", creds, "nosuchjob")
    assert unknown.returncode == 1 and "no job 'nosuchjob'" in unknown.stderr
    chosen = crawlmesh(mesh, "submit", "--creds", creds, "--job-id", job, sites.quick.url("/b"))
    assert chosen.returncode == 1 and "already in use" in chosen.stderr
