"""`crawlmesh crawl` with no mesh running: it starts one, shares it, and stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.sites import Site, free_port, html, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def site() -> Site:
    site = Site()
    for i in range(30):
        site.pages[f"/p{i}"] = (200, "text/html", html(f'<a href="/p{i + 1}">next</a>', f"P{i}"))
    site.start()
    yield site
    site.stop()


def crawl_env(tmp_path: Path, delay_s: float) -> dict[str, str]:
    return {**os.environ, "CRAWLMESH_HOME": str(tmp_path / "home"),
            "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{free_port()}",
            "CRAWLMESH_FETCHER_HOST_DELAYS": f'{{"127.0.0.*": {delay_s}}}'}


def mesh_processes(home: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            env = proc.info["environ"] or {}
        except psutil.Error:
            continue
        if ("shared.cli.main" in cmd or "nats-server" in cmd) and (
            env.get("CRAWLMESH_HOME") == str(home) or str(home) in cmd
        ):
            found.append(proc)
    return found


def crawl(env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "crawl", "--wait", *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_two_crawls_share_one_embedded_mesh_and_the_last_stops_it(
    tmp_path: Path, site: Site
) -> None:
    env = crawl_env(tmp_path, 0)
    first = crawl(env, "--max-pages", "10", "--max-depth", "100", site.url("/p0"))
    second = crawl(env, "--max-pages", "20", "--max-depth", "100", site.url("/p5"))
    out1, _ = first.communicate(timeout=120)
    out2, _ = second.communicate(timeout=120)
    assert first.returncode == 0, out1.decode()
    assert second.returncode == 0, out2.decode()
    assert b"completed: 10 pages" in out1 and b"completed: 20 pages" in out2
    assert (out1 + out2).count(b"starting the embedded mesh") == 1  # one mesh, shared
    wait_for(lambda: not mesh_processes(tmp_path / "home"), 30, "the mesh to stop")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_crawl_cancels_the_job_and_stops_the_mesh(
    tmp_path: Path, site: Site, sig: signal.Signals
) -> None:
    env = crawl_env(tmp_path, 0.5)
    proc = crawl(env, site.url("/p0"))
    wait_for(lambda: len(site.requests) >= 3, 60, "the crawl to be under way")
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out.decode()
    assert b"cancelled" in out, out.decode()
    wait_for(lambda: not mesh_processes(tmp_path / "home"), 30, "the mesh to stop")
    fetched = len(site.requests)
    assert fetched < 30
