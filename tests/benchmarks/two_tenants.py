"""Benchmark: two tenants crawl at once; A's storage quota fills; B is not slowed down.

Not a test (pytest does not collect it): it prints figures and the command to reproduce
them. Needs the corpus served (``../shared/corpus/serve start``).

1. B alone: tenant ``b`` crawls the Django docs host; time from submission to its
   ``completed`` event.
2. Together: tenant ``a`` (quota ``--a-storage``, too small for its crawl) crawls the
   PostgreSQL docs host while ``b`` crawls the Django host again (a new job). A's quota
   fills: its pages are parked, its admission pauses, and it gets a quota event; B's time
   is measured and compared with step 1 (the target: at most 1.5x).
3. ``tenant update a --storage`` raises A's quota: A resumes and completes; every page of
   A is in A's RESULTS exactly once, and each tenant's RESULTS hold only its own job.

Run::

    ../shared/corpus/serve start
    python tests/benchmarks/two_tenants.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from nats.aio.client import Client

from shared.accounts.claims import TenantQuota
from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.launcher import running_mesh
from shared.settings import MeshSettings

REPO = Path(__file__).resolve().parents[2]
A_HOST = "http://127.0.0.3:8080/index.html"  # PostgreSQL docs, 1,169 HTML files
B_HOST = "http://127.0.0.4:8080/index.html"  # Django docs, 692 HTML files


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def submit(nc: Client, seed: str, job: str) -> None:
    request = {"seeds": [seed], "job_id": job, "max_depth": 100, "max_pages": 100_000}
    ack = await nc.jetstream().publish("crawl.seeds", orjson.dumps(request))
    assert ack.stream.startswith("INTAKE_"), ack


async def events(nc: Client, job: str) -> list[dict[str, object]]:
    """Every event of ``job`` in the tenant's EVENTS stream, oldest first."""
    js = nc.jetstream()
    try:
        info = await js.stream_info("EVENTS", subjects_filter=f"crawl.events.{job}")
    except Exception:
        return []
    out = []
    total = sum((info.state.subjects or {}).values())
    seq = 0
    while len(out) < total:
        try:
            msg = await js.get_msg("EVENTS", seq=seq + 1, next=True,
                                   subject=f"crawl.events.{job}")
        except Exception:
            break
        seq = msg.seq
        out.append(orjson.loads(msg.data))
    return out


async def wait_event(nc: Client, job: str, kinds: set[str], timeout_s: float,
                     reason: str | None = None) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in await events(nc, job):
            if event["kind"] in kinds and (reason is None or reason in str(event.get("reason"))):
                return event
            if event["kind"] in ("completed", "cancelled", "rejected"):
                raise RuntimeError(f"job {job} ended ({event['kind']}) before a {kinds} event: "
                                   f"{event}")
        await asyncio.sleep(0.25)
    raise TimeoutError(f"job {job}: no {kinds} event within {timeout_s} s")


async def result_urls(nc: Client, job: str) -> list[str]:
    """URLs of every result of ``job`` in the tenant's RESULTS (read with an ordered
    consumer)."""
    js = nc.jetstream()
    info = await js.stream_info("RESULTS", subjects_filter=f"crawl.results.{job}")
    total = sum((info.state.subjects or {}).values())
    sub = await js.subscribe(f"crawl.results.{job}", ordered_consumer=True)
    urls = []
    try:
        while len(urls) < total:
            msg = await sub.next_msg(timeout=10)
            urls.append(orjson.loads(msg.data)["url"])
    finally:
        await sub.unsubscribe()
    return urls


async def other_jobs(nc: Client, job: str) -> set[str]:
    info = await nc.jetstream().stream_info("RESULTS", subjects_filter="crawl.results.>")
    return {s.rsplit(".", 1)[1] for s in (info.state.subjects or {})} - {job}


async def timed_crawl(nc: Client, seed: str, job: str) -> float:
    start = time.monotonic()
    await submit(nc, seed, job)
    await wait_event(nc, job, {"completed"}, 600)
    return time.monotonic() - start


async def run(settings: MeshSettings, a_storage: int, raised: int) -> int:
    keys = KeyStore(settings.home)
    async with TenantControl.open(settings) as control:
        await control.add("a", TenantQuota(storage_bytes=a_storage))
        await control.add("b")
    a = await connect(settings, "bench-a", persistent=False, creds=keys.tenant_creds("a"))
    b = await connect(settings, "bench-b", persistent=False, creds=keys.tenant_creds("b"))
    try:
        alone = await timed_crawl(b, B_HOST, "b-alone")
        b_alone_pages = len(await result_urls(b, "b-alone"))
        print(f"B alone: {b_alone_pages} results in {alone:.1f} s")

        start = time.monotonic()
        await submit(a, A_HOST, "a-job")
        b_task = asyncio.create_task(timed_crawl(b, B_HOST, "b-together"))
        quota_event = await wait_event(a, "a-job", {"progress", "paused", "quota"}, 600,
                                       reason="storage quota exceeded")
        paused_at = time.monotonic() - start
        print(f"A paused after {paused_at:.1f} s: {quota_event.get('reason')}")
        together = await b_task
        b_pages = len(await result_urls(b, "b-together"))
        print(f"B beside A (A over quota): {b_pages} results in {together:.1f} s "
              f"= {together / alone:.2f}x its time alone (target <= 1.5x)")
        a_events = await events(a, "a-job")
        assert not any(e["kind"] == "completed" for e in a_events), "A completed while over quota"
        stored_before = len(await result_urls(a, "a-job"))
        print(f"A while paused: {stored_before} results stored, job not completed")

        raise_at = time.monotonic()
        async with TenantControl.open(settings) as control:
            await control.update("a", storage_bytes=raised)
        done = await wait_event(a, "a-job", {"completed"}, 600)
        urls = await result_urls(a, "a-job")
        print(f"A after `tenant update a --storage {raised}`: completed "
              f"{time.monotonic() - raise_at:.1f} s later; {len(urls)} results, "
              f"{len(set(urls))} distinct URLs; counters {done.get('counters')}")
        ok = len(urls) == len(set(urls)) and b_pages == b_alone_pages
        others_a, others_b = await other_jobs(a, "a-job"), await other_jobs(b, "b-together")
        print(f"jobs visible in A's RESULTS besides a-job: {sorted(others_a) or 'none'}; "
              f"in B's besides b-together: {sorted(others_b)}")
        ok = ok and not others_a and others_b == {"b-alone"}
        ok = ok and together <= 1.5 * alone
        print("OK" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        await a.close()
        await b.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a-storage", type=int, default=384 << 10,
                        help="tenant a's storage quota while it crawls, bytes")
    parser.add_argument("--raised", type=int, default=1 << 30,
                        help="tenant a's quota after `tenant update`, bytes")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="crawlmesh-bench-"))
    env = {**os.environ, "CRAWLMESH_HOME": str(home),
           "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{free_port()}",
           "CRAWLMESH_METRICS_BASE_PORT": "0",
           "CRAWLMESH_FETCHER_HOST_DELAYS": '{"127.0.0.*": 0}'}
    mesh = subprocess.Popen([sys.executable, "-m", "shared.cli.main", "up"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while running_mesh(home) is None:
            if mesh.poll() is not None or time.monotonic() > deadline:
                print((mesh.stderr.read() if mesh.stderr else b"").decode()[-3000:])
                return 1
            time.sleep(0.2)
        os.environ.update(env)
        settings = MeshSettings()
        print(f"mesh up ({settings.nats_url}, home {home}); python {sys.version.split()[0]}, "
              f"{os.cpu_count()} cores")
        code = asyncio.run(run(settings, args.a_storage, args.raised))
        print("reproduce: ../shared/corpus/serve start && python tests/benchmarks/two_tenants.py"
              f" --a-storage {args.a_storage} --raised {args.raised}")
        return code
    finally:
        mesh.terminate()
        mesh.wait(60)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
