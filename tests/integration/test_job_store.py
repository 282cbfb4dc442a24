"""Job records and tenant listings read from a real nats-server's KV buckets.

These paths once went through nats-py's ``KeyValue.keys()``, which came back empty under
load (``crawlmesh status`` listed no jobs in CI) and whose ``filters`` match substrings, so
the concurrent-jobs limit counted no job at all. Here they are checked against the server.
"""

from __future__ import annotations

import orjson
from nats.js import JetStreamContext

from services.seeder.handler import RawSubmission, SeederHandler
from shared import subjects
from shared.accounts.claims import TenantQuota
from shared.bus.kvkeys import kv_keys, live_entries
from shared.bus.loop import Delivery
from shared.contracts import CrawlRequest, DiscoveredLinks, JobEvent, JobEventKind, JobRecord, JobState
from shared.jobs import JobStore
from shared.streams import JOBS_BUCKET, TENANTS_BUCKET
from shared.tenancy import TenantRegistry
from shared.tenantgate import TenantGate


def record(tenant: str, job: str, state: JobState = JobState.RUNNING) -> JobRecord:
    return JobRecord(tenant=tenant, job_id=job, state=state,
                     request=CrawlRequest(seeds=["https://example.org/"]))


async def test_listing_finds_every_key_by_pattern_and_leaves_out_deleted_ones(
    js: JetStreamContext,
) -> None:
    kv = await js.key_value(JOBS_BUCKET)
    for key in ("acme.j1", "acme.j2", "acmex.j1", "other.j1", "gone.j1", "purged.j1"):
        await kv.put(key, key.encode())
    await kv.delete("gone.j1")
    await kv.purge("purged.j1")

    assert await kv_keys(js, JOBS_BUCKET, "acme.*") == ["acme.j1", "acme.j2"]
    assert await live_entries(js, kv, JOBS_BUCKET, "acme.*") == {
        "acme.j1": b"acme.j1", "acme.j2": b"acme.j2"}
    every = await live_entries(js, kv, JOBS_BUCKET)
    assert sorted(every) == ["acme.j1", "acme.j2", "acmex.j1", "other.j1"]
    assert await live_entries(js, kv, JOBS_BUCKET, "nobody.*") == {}


async def test_job_store_lists_counts_and_removes_one_tenants_jobs(js: JetStreamContext) -> None:
    store = JobStore(js)
    for job, state in (("j1", JobState.RUNNING), ("j2", JobState.COMPLETED),
                       ("j3", JobState.RUNNING)):
        await store.create(record("acme", job, state))
    await store.create(record("acmex", "j9"))

    assert [r.job_id for r in await store.all("acme")] == ["j1", "j2", "j3"]
    assert await store.running_count("acme") == 2
    assert await store.running_count("acmex") == 1
    assert len(await store.all()) == 4

    await store.delete_all("acme")
    assert await store.all("acme") == []
    assert await store.running_count("acme") == 0
    assert [r.job_id for r in await store.all("acmex")] == ["j9"]


async def test_the_concurrent_jobs_limit_holds_with_the_real_job_store(
    js: JetStreamContext, tenant: str,
) -> None:
    registry = TenantRegistry(js)
    current = await registry.get(tenant)
    await registry.put(current.model_copy(update={"quota": TenantQuota(max_concurrent_jobs=2)}))
    handler = SeederHandler(JobStore(js), TenantGate(js, ttl_s=0))

    def delivery(seq: int) -> Delivery:
        return Delivery(subject=subjects.seeds(tenant), headers={}, delivered=1,
                        stream_seq=seq, tenant=tenant, job=subjects.NO_JOB,
                        published_at=None)

    submission = RawSubmission(orjson.dumps({"seeds": ["https://example.org/"]}))
    for seq in (1, 2):
        outputs = await handler.handle(submission, delivery(seq))
        assert any(isinstance(o.message, DiscoveredLinks) for o in outputs)
    (refused,) = await handler.handle(submission, delivery(3))
    assert isinstance(refused.message, JobEvent)
    assert refused.message.kind is JobEventKind.REJECTED
    assert "limit of concurrent jobs is 2" in (refused.message.reason or "")

    store = JobStore(js)
    first = (await store.all(tenant))[0]
    assert await store.transition(tenant, first.job_id, JobState.COMPLETED)
    outputs = await handler.handle(submission, delivery(4))
    assert any(isinstance(o.message, DiscoveredLinks) for o in outputs)


async def test_tenant_listing_sees_every_registered_tenant(js: JetStreamContext,
                                                           tenant: str) -> None:
    records = await TenantRegistry(js).records()
    assert [r.id for r in records] == [tenant]
    assert await kv_keys(js, TENANTS_BUCKET, "tenant.*") == [f"tenant.{tenant}"]
    assert await TenantGate(js).paused_tenants() == []
