"""End to end: one page's trace crosses the service processes, and its links lead back to
the seeder, so a page's lineage spans all five; service logs are JSON joined to traces.

Spans are collected out of process: each service writes its finished spans to its own
file (``CRAWLMESH_TRACE_FILE`` with ``{service}`` and ``{pid}``), read once the mesh stops.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import orjson
import pytest

from shared.launcher import SERVICES
from tests.integration.meshproc import MeshProcess
from tests.integration.test_crawl import crawl, read_results
from tests.sites import Site, html

pytestmark = pytest.mark.timeout(120)

Span = dict


def flaky_once(site: Site) -> object:
    """A route that answers 503 to its first request and 200 after (one nak, one retry)."""

    def route(handler: BaseHTTPRequestHandler) -> None:
        first = site.requests.count("/flaky") == 1
        body = html("fine now", "Flaky")
        handler.send_response(503 if first else 200)
        handler.send_header("Content-Type", "text/html")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return route


def read_spans(folder: Path) -> list[Span]:
    return [orjson.loads(text) for path in sorted(folder.glob("*.jsonl"))
            for text in path.read_bytes().splitlines() if text.strip()]


def page_root(spans: list[Span], url: str) -> Span:
    [root] = [s for s in spans if s["name"] == "page" and s["attributes"].get("url.full") == url]
    return root


def test_a_page_trace_crosses_the_service_processes(tmp_path: Path) -> None:
    site = Site()
    site.pages = {
        "/robots.txt": (404, "text/plain", b""),
        "/": (200, "text/html", html('<a href="/a">a</a> <a href="/flaky">f</a>', "Home")),
        "/a": (200, "text/html", html('<a href="/b">b</a> <a href="/">home</a>', "A")),
        "/b": (200, "text/html", html("leaf", "B")),
    }
    site.routes = {"/flaky": flaky_once(site)}
    site.start()
    span_dir = tmp_path / "spans"
    mesh = MeshProcess(tmp_path / "home", env={
        "CRAWLMESH_TRACE_FILE": str(span_dir / "{service}-{pid}.jsonl"),
    }).start()
    try:
        job, _ = asyncio.run(crawl(mesh, site.url("/"), tmp_path / "r.jsonl"))
        results = read_results(tmp_path / "r.jsonl")
    finally:
        assert mesh.stop() == 0
        site.stop()
    assert sorted(r["url"] for r in results) == sorted(
        site.url(p) for p in ("/", "/a", "/b", "/flaky"))
    spans = read_spans(span_dir)
    by_id = {s["span_id"]: s for s in spans}
    traces: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    assert {s["service"] for s in spans} == {f"crawlmesh-{name}" for name in SERVICES}

    # (a) the page /b has a trace of its own, from admission (dedup) to result (sink),
    # every span of it connected to its root, in four different processes.
    root = page_root(spans, site.url("/b"))
    assert root["parent"] is None and root["kind"] == "PRODUCER"
    assert root["service"] == "crawlmesh-dedup"
    assert root["attributes"]["crawlmesh.job"] == job
    page = traces[root["trace_id"]]
    for span in page:
        if span is not root:
            assert span["parent"] in by_id, f"{span['name']} is not connected to the trace"
            assert by_id[span["parent"]]["trace_id"] == root["trace_id"]
    consumers = {(s["service"], s["name"]): s for s in page if s["kind"] == "CONSUMER"}
    assert set(consumers) == {
        ("crawlmesh-fetcher", "process frontier"), ("crawlmesh-parser", "process fetched"),
        ("crawlmesh-sink", "process parsed"),  # the page's result
        ("crawlmesh-dedup", "process links"), ("crawlmesh-sink", "process expanded"),
    }
    assert consumers["crawlmesh-fetcher", "process frontier"]["parent"] == root["span_id"]
    for span in consumers.values():
        assert span["attributes"]["messaging.system"] == "nats"
        assert span["attributes"]["crawlmesh.tenant"] == root["attributes"]["crawlmesh.tenant"]
        assert span["attributes"]["crawlmesh.job"] == job
        assert span["attributes"]["crawlmesh.outcome"] == "ack"
    pids = {(s["service"], s["pid"]) for s in page}
    assert len({pid for _, pid in pids}) == len({service for service, _ in pids}) >= 4

    # (b) its root links to the dedup span that admitted it, in the trace of the page that
    # discovered it (/a); following links back reaches the submission's trace (seeder).
    lineage: list[str] = []
    services = {s["service"] for s in page}
    current = root
    while current["name"] == "page":
        [link] = current["links"]
        admitter = by_id[link["span_id"]]
        assert admitter["trace_id"] == link["trace_id"] != current["trace_id"]
        assert (admitter["service"], admitter["name"]) == ("crawlmesh-dedup", "process links")
        lineage.append(current["attributes"]["url.full"])
        [current] = [s for s in traces[link["trace_id"]] if s["parent"] is None]
        services |= {s["service"] for s in traces[link["trace_id"]]}
    assert lineage == [site.url("/b"), site.url("/a"), site.url("/")]
    assert (current["service"], current["name"]) == ("crawlmesh-seeder", "process seeds")
    assert services == {f"crawlmesh-{name}" for name in SERVICES}

    # Service logs are JSON lines; the fetcher's nak of /flaky is logged inside its trace.
    for name in SERVICES:
        lines = [orjson.loads(text) for text in mesh.log(name).splitlines() if text.strip()]
        assert lines and all(doc["service"] == name for doc in lines)
    flaky = traces[page_root(spans, site.url("/flaky"))["trace_id"]]
    naks = [doc for doc in map(orjson.loads, mesh.log("fetcher").splitlines())
            if doc["message"].startswith("nak ")]
    assert [(d["trace_id"], d["tenant"], d["job"]) for d in naks] == [
        (flaky[0]["trace_id"], root["attributes"]["crawlmesh.tenant"], job)]
    assert naks[0]["span_id"] in {s["span_id"] for s in flaky if s["status"] == "ERROR"}
