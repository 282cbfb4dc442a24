"""`crawlmesh up` starts nats-server and five service processes; a seed reaches RESULTS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import psutil
import pytest

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.launcher import SERVICES
from shared.settings import MeshSettings
from shared.streams import RESULTS
from shared.tenancy import DEFAULT_TENANT
from tests.sites import Site, free_port, html, wait_for


@pytest.fixture
def site() -> Site:
    site = Site()
    site.pages = {
        "/": (200, "text/html", html('<a href="/a">a</a> <a href="/b">b</a>', "Home")),
        "/a": (200, "text/html", html('<a href="/">home</a>', "A")),
        "/b": (200, "text/html", html("leaf", "B")),
    }
    site.start()
    yield site
    site.stop()


async def _publish_and_collect(settings: MeshSettings, seed: str, expected: int) -> list[dict]:
    """Publish a bare URL on ``crawl.seeds`` as the default tenant's user (its creds file,
    written by `crawlmesh up`) and read its RESULTS stream."""
    tnc = await connect(settings, "test", creds=KeyStore(settings.home).tenant_creds(DEFAULT_TENANT))
    try:
        tjs = tnc.jetstream()
        await tjs.publish("crawl.seeds", seed.encode())
        seen: list[dict] = []
        for _ in range(300):
            info = await tjs.stream_info(RESULTS)
            if info.state.messages >= expected:
                break
            await asyncio.sleep(0.1)
        sub = await tjs.pull_subscribe("crawl.results.>", durable=None, stream=RESULTS)
        for msg in await sub.fetch(expected + 5, timeout=2):
            seen.append(orjson.loads(msg.data))
        return seen
    finally:
        await tnc.close()


def test_up_runs_five_services_and_a_seed_reaches_results(tmp_path: Path, site: Site) -> None:
    port = free_port()
    env = {**os.environ, "CRAWLMESH_HOME": str(tmp_path / "home"),
           "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{port}"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "up"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        state = tmp_path / "home" / "mesh.json"
        wait_for(state.exists, 30, "mesh.json")
        assert json.loads(state.read_text())["pid"] == launcher.pid
        kids = psutil.Process(launcher.pid).children()
        commands = [" ".join(k.cmdline()) for k in kids]
        assert any("nats-server" in c for c in commands), commands
        for name in SERVICES:
            assert any(c.endswith(f"service {name}") for c in commands), (name, commands)

        settings = MeshSettings(home=tmp_path / "home", nats_url=f"nats://127.0.0.1:{port}")
        results = asyncio.run(_publish_and_collect(settings, site.url("/"), 3))
        urls = sorted(r["url"] for r in results)
        assert urls == sorted(site.url(p) for p in ("/", "/a", "/b"))
        assert {r["title"] for r in results} == {"Home", "A", "B"}
    finally:
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, out.decode()
    assert not (tmp_path / "home" / "mesh.json").exists()
