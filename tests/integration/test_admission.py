"""Dedup admission (:class:`services.dedup.admission.KvAdmission`) against a real KV bucket.

Each test gets its own nats-server with the ``pages`` bucket ensured (``tests/conftest.py``).
Two :class:`KvAdmission` objects with their own caches stand for two dedup replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from services.dedup.admission import Candidate, KvAdmission
from shared import subjects
from shared.bus.connection import connect
from shared.settings import MeshSettings
from shared.streams import PAGES_BUCKET
from shared.subjects import Stage
from shared.urls import fingerprint

UNLIMITED = 10_000


def cands(host: str, *paths: str) -> list[Candidate]:
    return [Candidate(fingerprint(f"http://{host}{path}"), host) for path in paths]


def cause(tenant: str, job: str, name: str) -> str:
    """A cause shaped like the dedup handler's (the msg id of the expansion report)."""
    return subjects.msg_id(Stage.DEDUP, tenant, job, f"from-{name}-0")


async def counter(js: JetStreamContext, key: str) -> int:
    kv = await js.key_value(PAGES_BUCKET)
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return 0
    return int(entry.value or b"0")


async def page_value(js: JetStreamContext, tenant: str, job: str, fp: str) -> str | None:
    kv = await js.key_value(PAGES_BUCKET)
    try:
        entry = await kv.get(f"{tenant}.{job}.{fp}")
    except KeyNotFoundError:
        return None
    return (entry.value or b"").decode()


@pytest.fixture
async def other_nc(settings: MeshSettings, nc: Client) -> AsyncIterator[Client]:
    """A second connection: a second dedup replica."""
    client = await connect(settings, name="crawlmesh-test-2")
    try:
        yield client
    finally:
        await client.close()


async def test_each_url_is_admitted_once_per_job_across_messages(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    admission = KvAdmission(js)
    first = cands("a.test", "/1", "/2", "/3")
    second = cands("a.test", "/2", "/3", "/4")
    got_first = await admission.admit(tenant, job, first, cause(tenant, job, "p1"), UNLIMITED, 0)
    got_second = await admission.admit(tenant, job, second, cause(tenant, job, "p2"), UNLIMITED, 0)
    assert got_first == first
    assert got_second == cands("a.test", "/4")
    # A fresh replica (empty cache) agrees: the KV key is the truth.
    replica = KvAdmission(js)
    assert await replica.admit(tenant, job, second, cause(tenant, job, "p3"), UNLIMITED, 0) == []
    assert await page_value(js, tenant, job, first[0].fingerprint) == \
        f"admitted {cause(tenant, job, 'p1')}"
    assert await counter(js, f"{tenant}.{job}._budget") == 4


async def test_another_job_admits_the_same_urls_again(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    admission = KvAdmission(js)
    links = cands("a.test", "/1", "/2")
    other_job = subjects.new_job_id() + "x"
    assert await admission.admit(tenant, job, links, cause(tenant, job, "p"), UNLIMITED, 0) == links
    assert await admission.admit(tenant, other_job, links, cause(tenant, other_job, "p"),
                                 UNLIMITED, 0) == links


async def test_concurrent_admissions_of_one_fingerprint_have_exactly_one_winner(
    js: JetStreamContext, other_nc: Client, tenant: str, job: str
) -> None:
    shared_links = cands("a.test", *(f"/s{i}" for i in range(20)))
    one, two = KvAdmission(js), KvAdmission(other_nc.jetstream())
    cause_one, cause_two = cause(tenant, job, "one"), cause(tenant, job, "two")
    got_one, got_two = await asyncio.gather(
        one.admit(tenant, job, shared_links, cause_one, UNLIMITED, 0),
        two.admit(tenant, job, list(reversed(shared_links)), cause_two, UNLIMITED, 0),
    )
    won_one = {c.fingerprint for c in got_one}
    won_two = {c.fingerprint for c in got_two}
    assert not won_one & won_two
    assert won_one | won_two == {c.fingerprint for c in shared_links}
    for cand in shared_links:
        owner = cause_one if cand.fingerprint in won_one else cause_two
        assert await page_value(js, tenant, job, cand.fingerprint) == f"admitted {owner}"
    # The loser's reservations were released: the budget counts admitted pages only.
    assert await counter(js, f"{tenant}.{job}._budget") == 20


async def test_redelivery_of_the_same_cause_readmits_even_with_the_budget_full(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    links = cands("a.test", "/1", "/2", "/3", "/4", "/5")
    cause_a = cause(tenant, job, "a")
    admission = KvAdmission(js)
    admitted = await admission.admit(tenant, job, links, cause_a, 3, 0)
    assert admitted == links[:3]
    assert await counter(js, f"{tenant}.{job}._budget") == 3

    # Same process (decisions cached) and a new replica after a crash (no cache): the same
    # three, so the handler republishes them (deduplicated by their msg ids).
    assert await admission.admit(tenant, job, links, cause_a, 3, 0) == admitted
    assert await KvAdmission(js).admit(tenant, job, links, cause_a, 3, 0) == admitted
    # Another message gets nothing once the budget is spent, and the budget did not move.
    more = cands("a.test", "/6", "/7")
    assert await KvAdmission(js).admit(tenant, job, more, cause(tenant, job, "b"), 3, 0) == []
    assert await counter(js, f"{tenant}.{job}._budget") == 3


async def test_redelivery_readmits_while_budget_remains_and_releases_its_reservation(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    links = cands("a.test", "/1", "/2")
    cause_a = cause(tenant, job, "a")
    assert await KvAdmission(js).admit(tenant, job, links, cause_a, 10, 0) == links
    assert await KvAdmission(js).admit(tenant, job, links, cause_a, 10, 0) == links
    assert await counter(js, f"{tenant}.{job}._budget") == 2


async def test_max_pages_is_never_exceeded_by_concurrent_messages(
    js: JetStreamContext, other_nc: Client, tenant: str, job: str
) -> None:
    replicas = [KvAdmission(js), KvAdmission(other_nc.jetstream()), KvAdmission(js)]
    batches = [cands("a.test", *(f"/m{m}/{i}" for i in range(10))) for m in range(3)]
    results = await asyncio.gather(*(
        replica.admit(tenant, job, batch, cause(tenant, job, f"m{m}"), 12, 0)
        for m, (replica, batch) in enumerate(zip(replicas, batches, strict=True))
    ))
    admitted = [c for result in results for c in result]
    assert len(admitted) == 12
    assert len({c.fingerprint for c in admitted}) == 12
    assert await counter(js, f"{tenant}.{job}._budget") == 12
    stored = [await page_value(js, tenant, job, c.fingerprint) for batch in batches for c in batch]
    assert sum(value is not None for value in stored) == 12


async def test_max_pages_is_never_exceeded_by_successive_messages(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    admission = KvAdmission(js)
    counts = []
    for m in range(3):
        batch = cands("a.test", *(f"/m{m}/{i}" for i in range(10)))
        counts.append(len(await admission.admit(tenant, job, batch, cause(tenant, job, f"m{m}"),
                                                12, 0)))
    assert counts == [10, 2, 0]
    assert await counter(js, f"{tenant}.{job}._budget") == 12


async def test_max_pages_per_host_is_honoured(js: JetStreamContext, tenant: str, job: str) -> None:
    admission = KvAdmission(js)
    first = cands("a.test", "/1", "/2", "/3", "/4", "/5") + cands("b.test", "/1")
    got = await admission.admit(tenant, job, first, cause(tenant, job, "p1"), UNLIMITED, 2)
    assert got == cands("a.test", "/1", "/2") + cands("b.test", "/1")
    second = cands("a.test", "/6") + cands("b.test", "/2", "/3")
    got = await KvAdmission(js).admit(tenant, job, second, cause(tenant, job, "p2"), UNLIMITED, 2)
    assert got == cands("b.test", "/2")
    # Reservations of the refused candidates were given back.
    assert await counter(js, f"{tenant}.{job}._budget") == 4
    assert await counter(js, KvAdmission._host_key(tenant, job, "a.test")) == 2
    assert await counter(js, KvAdmission._host_key(tenant, job, "b.test")) == 2


async def test_a_host_cap_does_not_waste_the_page_budget(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    """Links over one host's cap must not crowd out links to other hosts within max_pages."""
    links = cands("a.test", "/1", "/2", "/3") + cands("b.test", "/1")
    got = await KvAdmission(js).admit(tenant, job, links, cause(tenant, job, "p"), 3, 2)
    assert got == cands("a.test", "/1", "/2") + cands("b.test", "/1")
    assert await counter(js, f"{tenant}.{job}._budget") == 3
    assert await counter(js, KvAdmission._host_key(tenant, job, "a.test")) == 2
    assert await counter(js, KvAdmission._host_key(tenant, job, "b.test")) == 1
    # With the page budget spent, a new host's reservation is given back.
    more = cands("c.test", "/1")
    assert await KvAdmission(js).admit(tenant, job, more, cause(tenant, job, "q"), 3, 2) == []
    assert await counter(js, KvAdmission._host_key(tenant, job, "c.test")) == 0
    assert await counter(js, f"{tenant}.{job}._budget") == 3


async def test_redelivery_readmits_with_the_host_cap_full(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    links = cands("a.test", "/1", "/2", "/3")
    cause_a = cause(tenant, job, "a")
    admitted = await KvAdmission(js).admit(tenant, job, links, cause_a, UNLIMITED, 2)
    assert admitted == links[:2]
    assert await KvAdmission(js).admit(tenant, job, links, cause_a, UNLIMITED, 2) == admitted
    assert await counter(js, KvAdmission._host_key(tenant, job, "a.test")) == 2
    assert await counter(js, f"{tenant}.{job}._budget") == 2


async def test_the_decision_cache_answers_without_the_kv(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    admission = KvAdmission(js)
    links = cands("a.test", "/1")
    cause_a = cause(tenant, job, "a")
    assert await admission.admit(tenant, job, links, cause_a, UNLIMITED, 0) == links
    kv = await js.key_value(PAGES_BUCKET)
    await kv.delete(f"{tenant}.{job}.{links[0].fingerprint}")
    # Only the cache can still know: a duplicate for another cause, admitted for its own.
    assert await admission.admit(tenant, job, links, cause(tenant, job, "b"), UNLIMITED, 0) == []
    assert await admission.admit(tenant, job, links, cause_a, UNLIMITED, 0) == links
    assert await counter(js, f"{tenant}.{job}._budget") == 1
    # A replica without that cache goes to the KV, where the key is gone.
    assert await KvAdmission(js).admit(tenant, job, links, cause(tenant, job, "b"),
                                       UNLIMITED, 0) == links
