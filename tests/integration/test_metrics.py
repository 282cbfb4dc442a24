"""Metrics end to end: every service process of `crawlmesh up` exports its metrics, and a
real Prometheus scrapes them.

One embedded mesh (metrics ports from a free range, see ``meshproc``) crawls a small
loopback site to completion; then each service's ``/metrics`` is read and checked against
the tenant's RESULTS stream, and Debian's ``prometheus`` binary is run against the
services' ports and queried over its HTTP API.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shared import subjects
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.jobs import export_results, submit, wait_for_job
from shared.contracts import CrawlRequest
from shared.launcher import SERVICES
from shared.streams import RESULTS
from shared.tenancy import DEFAULT_TENANT, TenantRegistry
from tests.integration.meshproc import MeshProcess
from tests.sites import Site, free_port, html, wait_for

pytestmark = pytest.mark.timeout(180)

PROMETHEUS = "prometheus"
"""Debian's ``prometheus`` package (``apt-get install prometheus``) puts it on the PATH."""


def build_site() -> Site:
    site = Site()
    site.pages = {
        "/robots.txt": (200, "text/plain", b"User-agent: *\nDisallow: /private\n"),
        "/": (200, "text/html", html(
            '<a href="/a">a</a> <a href="/b">b</a> <a href="/missing">m</a> '
            '<a href="/private">p</a> <a href="http://elsewhere.invalid/">x</a>', "Home")),
        "/a": (200, "text/html", html('<a href="/">home</a> <a href="/b">b</a>', "A")),
        "/b": (200, "text/html", html("leaf", "B")),
    }
    return site.start()


@dataclass
class Crawled:
    mesh: MeshProcess
    tenant: str
    job: str
    results: int
    """Results exported for the job."""
    stored: int
    """Messages in the tenant's RESULTS stream."""


async def crawl(mesh: MeshProcess, seed: str, out: Path) -> tuple[str, str, int, int]:
    nc = await connect(mesh.settings, "test-client")
    tnc = await connect(mesh.settings, "test-tenant",
                        creds=KeyStore(mesh.home).tenant_creds(DEFAULT_TENANT))
    try:
        tenant = await TenantRegistry(nc.jetstream()).resolve(DEFAULT_TENANT)
        job = await submit(tnc, CrawlRequest(seeds=(seed,)))
        await wait_for_job(tnc, job, show=False)
        exported = await export_results(tnc, job, out)
        info = await tnc.jetstream().stream_info(RESULTS)
        return tenant, job, exported, int(info.state.messages)
    finally:
        await tnc.close()
        await nc.close()


@pytest.fixture(scope="module")
def crawled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crawled]:
    """A mesh that has crawled the site to completion (stopped after the module)."""
    tmp = tmp_path_factory.mktemp("metrics")
    site = build_site()
    with pytest.MonkeyPatch.context() as patch:  # module scope: clean the environment here
        for name in [n for n in os.environ if n.startswith("CRAWLMESH_")]:
            patch.delenv(name)
        mesh = MeshProcess(tmp / "home", env={"CRAWLMESH_METRICS_REFRESH_S": "0.5"}).start()
    try:
        tenant, job, results, stored = asyncio.run(crawl(mesh, site.url("/"), tmp / "out.jsonl"))
        yield Crawled(mesh, tenant, job, results, stored)
    finally:
        assert mesh.stop() == 0
        site.stop()


def scrape(url: str) -> list[Sample]:
    response = httpx.get(f"{url}/metrics", timeout=5)
    assert response.status_code == 200, response.text
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_each_service_serves_health_readiness_and_metrics(crawled: Crawled) -> None:
    endpoints = crawled.mesh.metrics
    assert set(endpoints) == set(SERVICES)
    assert len({url for url in endpoints.values()}) == len(SERVICES)
    for name, url in endpoints.items():
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200, name
        ready = httpx.get(f"{url}/readyz", timeout=5)
        assert ready.status_code == 200, (name, ready.text)
        assert httpx.get(f"{url}/nothing", timeout=5).status_code == 404
        samples = scrape(url)
        assert total(samples, "crawlmesh_messages_total", stage=name, outcome="ack") > 0, name


def test_counters_agree_with_the_results_stream(crawled: Crawled) -> None:
    tenant, urls = crawled.tenant, crawled.mesh.metrics
    # /, /a, /b, /missing, /private: 5 pages, one result each
    assert crawled.results == crawled.stored == 5

    sink = scrape(urls["sink"])
    assert total(sink, "crawlmesh_results_stored_total") == crawled.stored
    assert total(sink, "crawlmesh_results_stored_total", tenant=tenant, outcome="ok") == 3
    assert total(sink, "crawlmesh_results_stored_total", outcome="http_error") == 1
    assert total(sink, "crawlmesh_results_stored_total", outcome="robots_disallowed") == 1
    assert total(sink, "crawlmesh_jobs_completed_total", tenant=tenant) == 1
    assert total(sink, "crawlmesh_quota_errors_total") == 0

    fetcher = scrape(urls["fetcher"])
    assert total(fetcher, "crawlmesh_fetch_duration_seconds_count", status_class="2xx") == 3
    assert total(fetcher, "crawlmesh_fetch_duration_seconds_count", status_class="4xx") == 1
    assert total(fetcher, "crawlmesh_fetch_response_bytes_count", status_class="2xx") == 3
    assert total(fetcher, "crawlmesh_fetch_response_bytes_sum", status_class="2xx") > 0
    assert total(fetcher, "crawlmesh_robots_decisions_total", decision="allowed") == 4
    assert total(fetcher, "crawlmesh_robots_decisions_total", decision="disallowed") == 1
    assert total(fetcher, "crawlmesh_politeness_wait_seconds_count") == 4

    dedup = scrape(urls["dedup"])
    assert total(dedup, "crawlmesh_dedup_links_total", tenant=tenant, decision="admitted") == 5
    assert total(dedup, "crawlmesh_dedup_links_total", decision="out_of_scope") >= 1
    assert total(dedup, "crawlmesh_dedup_links_total", decision="duplicate") >= 2  # /a -> /, /b

    for name, url in urls.items():  # the consume loops' histogram, in every process
        assert total(scrape(url), "crawlmesh_handler_duration_seconds_count") > 0, name


def test_sink_publishes_jetstream_gauges(crawled: Crawled) -> None:
    url, tenant = crawled.mesh.metrics["sink"], crawled.tenant

    def gauges_read() -> bool:
        return total(scrape(url), "crawlmesh_tenant_storage_bytes", tenant=tenant) > 0

    wait_for(gauges_read, 10, "the tenant storage gauge")
    sink = scrape(url)
    limit = crawled.mesh.settings.tenant_results_max_bytes
    assert total(sink, "crawlmesh_tenant_storage_limit_bytes", tenant=tenant) == limit
    consumers = {(s.labels["stream"], s.labels["consumer"]) for s in sink
                 if s.name == "crawlmesh_consumer_pending_messages"}
    assert {("LINKS", f"dedup-{tenant}"), ("FETCHED", f"parser-{tenant}"),
            ("PARSED", f"sink-{tenant}")} <= consumers
    assert {c for s, c in consumers if s == "FRONTIER"} == {
        f"fetcher-p{n}" for n in range(subjects.PARTITIONS)}
    assert total(sink, "crawlmesh_consumer_pending_messages") == 0  # the job is done
    assert total(sink, "crawlmesh_consumer_ack_pending_messages",
                 consumer=f"sink-{tenant}") == 0
    for name, service_url in crawled.mesh.metrics.items():  # only the sink publishes them
        if name != "sink":
            assert total(scrape(service_url), "crawlmesh_tenant_storage_bytes") == 0, name


def prometheus_config(path: Path, endpoints: dict[str, str]) -> Path:
    """A scrape config: one static target per service process, scraped every second."""
    lines = ["global:", "  scrape_interval: 1s", "  scrape_timeout: 1s",
             "scrape_configs:", "  - job_name: crawlmesh", "    static_configs:"]
    for name, url in endpoints.items():
        lines += [f"      - targets: ['{url.removeprefix('http://')}']",
                  f"        labels: {{service: '{name}'}}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_real_prometheus_scrapes_the_services(crawled: Crawled, tmp_path: Path) -> None:
    binary = shutil.which(PROMETHEUS)
    if binary is None:
        pytest.fail("the prometheus binary is missing: install Debian's package "
                    "(apt-get install -y --no-install-recommends prometheus; .ci/run does)")
    port = free_port()
    config = prometheus_config(tmp_path / "prometheus.yml", crawled.mesh.metrics)
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list[dict]:
        response = httpx.get(f"{api}/query", params={"query": expr}, timeout=5)
        assert response.status_code == 200, response.text
        return list(response.json()["data"]["result"])

    def answered(expr: str, value: float) -> bool:
        if server.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{log.read_text()[-3000:]}")
        try:
            result = query(expr)
        except httpx.TransportError:  # not listening yet
            return False
        return bool(result) and float(result[0]["value"][1]) == value

    try:
        wait_for(lambda: b"Server is ready to receive web requests" in log.read_bytes(), 30,
                 "prometheus to start")
        wait_for(lambda: answered("sum(crawlmesh_results_stored_total)", crawled.stored), 30,
                 f"prometheus to report {crawled.stored} stored results")
        wait_for(lambda: answered("count(up == 1)", len(SERVICES)), 30,
                 "every service target to be up")
        by_service = {r["metric"]["service"] for r in query("crawlmesh_messages_total")}
        assert by_service == set(SERVICES)
        assert answered(f'sum(crawlmesh_jobs_completed_total{{tenant="{crawled.tenant}"}})', 1)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
