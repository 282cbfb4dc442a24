"""Server-enforced per-tenant caps on the stage streams are back-pressure, not failures.

With ``CRAWLMESH_STAGE_MAX_MSGS_PER_SUBJECT=1`` a job may hold one message at a time in each
of LINKS, FETCHED and PARSED (the server refuses the next: ``discard_new_per_subject``).
Publishers that find their subject full hold their input and retry; the crawl must still
finish with every page exactly once, no dead letters, and the caps must really have been
hit (the services' ``crawlmesh_backpressure_waits_total`` counters).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from shared import streams
from shared.bus.connection import connect
from tests.integration.meshproc import MeshProcess
from tests.integration.test_crawl import crawl, read_results
from tests.sites import ring_site

pytestmark = pytest.mark.timeout(180)


def waits(metrics_text: str) -> dict[str, float]:
    """``{full stage: waits}`` summed from a Prometheus exposition."""
    out: dict[str, float] = {}
    for match in re.finditer(
            r'^crawlmesh_backpressure_waits_total\{([^}]*)\} ([0-9.e+]+)$', metrics_text, re.M):
        stage = re.search(r'full_stage="([^"]+)"', match.group(1))
        assert stage is not None
        out[stage.group(1)] = out.get(stage.group(1), 0.0) + float(match.group(2))
    return out


def test_a_job_at_its_stage_caps_is_held_back_and_still_completes_exactly_once(
        tmp_path: Path) -> None:
    pages = 120
    site = ring_site(pages, fanout=7)
    mesh = MeshProcess(tmp_path / "home",
                       env={"CRAWLMESH_STAGE_MAX_MSGS_PER_SUBJECT": "1"}).start()

    async def run() -> tuple[dict, dict[str, float], int, dict[str, int]]:
        _job, info = await crawl(mesh, site.url("/p0"), tmp_path / "r.jsonl", max_depth=100)
        seen: dict[str, float] = {}
        async with httpx.AsyncClient() as client:
            for url in mesh.metrics.values():
                for stage, count in waits((await client.get(f"{url}/metrics")).text).items():
                    seen[stage] = seen.get(stage, 0.0) + count
        nc = await connect(mesh.settings, "test-inspect", persistent=False)
        try:
            js = nc.jetstream()
            dead = (await js.stream_info(streams.DLQ.name)).state.messages
            caps = {spec.name: (await js.stream_info(spec.name)).config.max_msgs_per_subject
                    for spec in (streams.LINKS, streams.FETCHED, streams.PARSED,
                                 streams.FRONTIER)}
        finally:
            await nc.close()
        return info, seen, dead, caps

    try:
        info, seen, dead, caps = asyncio.run(run())
        results = read_results(tmp_path / "r.jsonl")
    finally:
        assert mesh.stop() == 0
        site.stop()

    assert caps == {"LINKS": 1, "FETCHED": 1, "PARSED": 1, "FRONTIER": -1}
    urls = [r["url"] for r in results]
    assert len(urls) == len(set(urls)), "duplicate results"
    assert set(urls) == {site.url(f"/p{i}") for i in range(pages)}
    assert all(r["outcome"] == "ok" for r in results)
    assert [e["kind"] for e in info["events"]].count("completed") == 1
    assert info["final"].counters.finished == pages
    assert dead == 0, "a full stage must hold its publisher back, not dead-letter"
    assert sum(seen.values()) > 0, f"the caps were never reached: {seen}"
