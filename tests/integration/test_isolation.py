"""Tenant isolation, attacked (issue 4, "Isolation tests"; DESIGN.md "Accounts and subjects").

Two real tenant accounts, ``a`` (the attacker, with a small quota) and ``b`` (the victim),
on a real nats-server in operator mode. B has results and events (written by MESH through
its activation-token imports) and seeds in its intake. Each test has A attack with its own
creds file (the user a tenant really gets), asserts the specific error A gets, and asserts
that B's data is exactly what it was (:func:`b_snapshot`).

How nats-py reports what the server refuses:
- a publish the user's permissions deny: the server sends ``-ERR 'Permissions Violation for
  Publish to "<subject>"'`` and keeps the connection; nats-py hands it to ``error_cb`` as
  ``nats.errors.Error("nats: permissions violation for publish to \\"<subject>\\"")``
  (lower-cased) and a request on that subject times out;
- a JetStream API or PubAck error: ``nats.js.errors.APIError`` subclasses with ``err_code``;
- a revoked user: the connection is closed, ``last_error`` "user authentication revoked";
  reconnecting gets "Authorization Violation".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import orjson
import pytest
from nats.aio.client import Client
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServerError

from shared import streams, subjects
from shared.accounts import claims
from shared.accounts.claims import TenantQuota
from shared.accounts.control import TenantControl
from shared.accounts.jwt import JwtError, KeyPair, decode, encode
from shared.accounts.keystore import MESH, OPERATOR_SIGNING, KeyStore
from shared.accounts.resolver import UPDATE, ClaimsResolver
from shared.bus.connection import connect
from shared.settings import MeshSettings
from shared.tenancy import TenantRecord

A_QUOTA = TenantQuota(storage_bytes=256 << 10, max_streams=2, max_consumers=2)
"""The attacker's quota: 256 KiB, only RESULTS and EVENTS, two consumers."""

WAIT_S = 5.0
JS_TIMEOUT_S = 1.0
"""JetStream API timeout of the attacker: a request its permissions deny times out."""


# ---- fixtures and helpers ------------------------------------------------------------------


@dataclass
class Attacker:
    """A tenant user's connection that records the asynchronous errors the server sends."""

    nc: Client
    errors: list[Exception] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def js(self) -> Any:
        return self.nc.jetstream(timeout=JS_TIMEOUT_S)

    async def violation(self, subject: str) -> str:
        """Wait for the server's permissions violation for publishing to ``subject``."""
        expected = f'nats: permissions violation for publish to "{subject.lower()}"'
        async with asyncio.timeout(WAIT_S):
            while True:
                for error in self.errors:
                    if str(error) == expected:
                        return expected
                self.changed.clear()
                await self.changed.wait()


@contextlib.asynccontextmanager
async def attacker(settings: MeshSettings, name: str) -> AsyncIterator[Attacker]:
    """Connect with the tenant's own creds file (as ``connect`` does), recording errors."""
    holder: list[Attacker] = []

    async def on_error(error: Exception) -> None:
        holder[0].errors.append(error)
        holder[0].changed.set()

    async def on_closed() -> None:
        holder[0].closed.set()

    nc = Client()
    holder.append(Attacker(nc))
    await nc.connect(
        servers=[settings.nats_url], name=f"attacker-{name}",
        user_credentials=str(KeyStore(settings.home).tenant_creds(name)),
        error_cb=on_error, closed_cb=on_closed, max_reconnect_attempts=2,
        reconnect_time_wait=0.2, connect_timeout=2,
    )
    try:
        yield holder[0]
    finally:
        await nc.close()


@dataclass
class Tenants:
    a: TenantRecord
    b: TenantRecord
    keys: KeyStore
    mesh: Client
    b_nc: Client
    b_before: dict[str, Any]


async def b_snapshot(t: Tenants) -> dict[str, Any]:
    """Everything B has: each message of its RESULTS and EVENTS (read by B itself) and of
    its intake stream (read by MESH), with sequence numbers and headers."""
    out: dict[str, Any] = {}
    for label, js, stream in (
        ("RESULTS", t.b_nc.jetstream(), streams.RESULTS),
        ("EVENTS", t.b_nc.jetstream(), streams.EVENTS),
        ("INTAKE", t.mesh.jetstream(), streams.intake_stream(t.b.id).name),
    ):
        info = await js.stream_info(stream)
        messages = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream, seq)
            messages.append((msg.seq, msg.subject, msg.data, dict(msg.headers or {})))
        out[label] = {"messages": messages, "bytes": info.state.bytes,
                      "last_seq": info.state.last_seq, "config": info.config.as_dict()}
    return out


@pytest.fixture
async def tenants(settings: MeshSettings) -> AsyncIterator[Tenants]:
    """Tenants ``a`` (quota :data:`A_QUOTA`) and ``b``; B holds 3 results, 2 events and 2
    seeds; ``b_before`` is its snapshot."""
    mesh = await connect(settings, "crawlmesh-test-mesh", persistent=False)
    try:
        await streams.ensure_mesh(mesh.jetstream(), settings)
        async with TenantControl.open(settings) as control:
            a = await control.add("a", A_QUOTA)
            b = await control.add("b")
        keys = KeyStore(settings.home)
        mjs = mesh.jetstream()
        for n in range(3):
            ack = await mjs.publish(subjects.results(b.id, "jobb"), f"b-result-{n}".encode(),
                                    headers={"Nats-Msg-Id": f"b-result-{n}"})
            assert ack.stream == streams.RESULTS
        for n in range(2):
            await mjs.publish(subjects.events(b.id, "jobb"), f"b-event-{n}".encode())
        b_nc = await connect(settings, "tenant-b", persistent=False,
                             creds=keys.tenant_creds("b"))
        try:
            bjs = b_nc.jetstream()
            for n in range(2):
                ack = await bjs.publish("crawl.seeds", f"https://b.example/{n}".encode(),
                                        headers={"Nats-Msg-Id": f"b-seed-{n}"})
                assert ack.stream == streams.intake_stream(b.id).name
            t = Tenants(a, b, keys, mesh, b_nc, {})
            t.b_before = await b_snapshot(t)
            assert len(t.b_before["RESULTS"]["messages"]) == 3
            assert len(t.b_before["INTAKE"]["messages"]) == 2
            yield t
        finally:
            await b_nc.close()
    finally:
        await mesh.close()


async def assert_b_intact(t: Tenants) -> None:
    assert await b_snapshot(t) == t.b_before


async def intake_count(t: Tenants, record: TenantRecord) -> int:
    info = await t.mesh.jetstream().stream_info(streams.intake_stream(record.id).name)
    return info.state.messages


# ---- reading -------------------------------------------------------------------------------


async def test_a_cannot_subscribe_to_b_results_or_events(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    got_b: asyncio.Queue[str] = asyncio.Queue()

    async def on_b(msg: Any) -> None:
        got_b.put_nowait(msg.subject)

    b_sub = await t.b_nc.subscribe("crawl.>", cb=on_b)
    await t.b_nc.flush()
    async with attacker(settings, "a") as a:
        seen: list[str] = []

        async def record(msg: Any) -> None:
            seen.append(msg.subject)

        for pattern in (">", "crawl.results.>", "crawl.events.>", f"tenant.{t.b.id}.>",
                        "$JS.>", "_INBOX.>"):
            await a.nc.subscribe(pattern, cb=record)
        await a.nc.flush()
        mjs = t.mesh.jetstream()
        await mjs.publish(subjects.results(t.b.id, "jobb"), b"b-result-live")
        await mjs.publish(subjects.events(t.b.id, "jobb"), b"b-event-live")
        # B's own subscription sees both (the messages really flowed, in B's account) ...
        async with asyncio.timeout(WAIT_S):
            assert {await got_b.get(), await got_b.get()} == {
                "crawl.results.jobb", "crawl.events.jobb"}
        await a.nc.flush()  # a round trip after B got them: anything routed to A is here
        # ... and A, subscribed to everything its account has, saw none of it.
        assert not [s for s in seen if "jobb" in s or t.b.id in s], seen
        assert not a.errors
    await b_sub.unsubscribe()


async def test_a_cannot_read_b_streams_through_the_js_api(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        ajs = a.js
        # "RESULTS" in A's account is A's own stream: B's 3 results are not in it.
        info = await ajs.stream_info(streams.RESULTS)
        assert info.state.messages == 0
        with pytest.raises(NotFoundError) as missing:
            await ajs.get_msg(streams.RESULTS, 1)
        assert missing.value.err_code == 10037  # no message found
        # A's account lists only its own two streams; MESH's and B's do not exist for it.
        names = orjson.loads((await a.nc.request("$JS.API.STREAM.NAMES", b"{}", timeout=2)).data)
        assert sorted(names["streams"]) == [streams.EVENTS, streams.RESULTS]
        for stream in (streams.intake_stream(t.b.id).name, streams.PARKED.name, "KV_tenants"):
            with pytest.raises(NotFoundError) as missing:
                await ajs.stream_info(stream)
            assert missing.value.err_code == 10059  # stream not found
            with pytest.raises(NotFoundError) as missing:
                await ajs.get_msg(stream, 1)
            assert missing.value.err_code == 10059
        # A's account info counts only A's own storage.
        account = orjson.loads((await a.nc.request("$JS.API.INFO", b"", timeout=2)).data)
        assert account["streams"] == 2 and account["storage"] == 0
    await assert_b_intact(t)


# ---- intake and MESH subjects --------------------------------------------------------------


async def test_a_cannot_publish_into_b_intake_or_mesh_subjects(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    mjs = t.mesh.jetstream()
    links_before = (await mjs.stream_info(streams.LINKS.name)).state.messages
    async with attacker(settings, "a") as a:
        targets = [
            subjects.seeds(t.b.id),
            f"mesh.links.{t.b.id}.jobb",
            f"mesh.frontier.0.{t.b.id}.jobb",
            f"mesh.parsed.{t.b.id}.jobb",
            f"tenant.{t.b.id}.results.jobb",
            "crawl.results.jobb",  # its own RESULTS: written by crawlmesh only
            "crawl.events.jobb",
            "$SYS.REQ.CLAIMS.UPDATE",  # pushing account JWTs
            f"$SYS.REQ.ACCOUNT.{t.b.id}.CONNZ",
        ]
        for subject in targets:
            await a.nc.publish(subject, b"evil")
        await a.nc.flush()
        for subject in targets:
            await a.violation(subject)
        # What A can publish, crawl.seeds, lands only in its own intake slot.
        ack = await a.js.publish("crawl.seeds", b"https://a.example/")
        assert ack.stream == streams.intake_stream(t.a.id).name
    # Even without user permissions (an admin user inside A's account), B's intake and
    # MESH's subjects are not in A's account: nobody answers there.
    async with TenantControl.open(settings) as control, \
            control.tenant_connection(t.a) as admin:
        for subject in (subjects.seeds(t.b.id), f"mesh.links.{t.b.id}.jobb",
                        f"tenant.{t.b.id}.results.jobb", "$SYS.REQ.CLAIMS.UPDATE"):
            with pytest.raises(nats.errors.NoRespondersError):
                await admin.request(subject, b"evil", timeout=2)
    assert (await mjs.stream_info(streams.LINKS.name)).state.messages == links_before
    assert await intake_count(t, t.a) == 1
    await assert_b_intact(t)


async def test_a_cannot_suppress_b_seeds_with_a_colliding_msg_id(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        # A pre-publishes the msg ids B used and will use.
        for msg_id in ("b-seed-0", "b-seed-1", "b-seed-2"):
            ack = await a.js.publish("crawl.seeds", b"https://a.example/",
                                     headers={"Nats-Msg-Id": msg_id})
            assert ack.stream == streams.intake_stream(t.a.id).name and not ack.duplicate
        dup = await a.js.publish("crawl.seeds", b"again", headers={"Nats-Msg-Id": "b-seed-2"})
        assert dup.duplicate  # A's own window works: only A's seeds are in it
    ack = await t.b_nc.jetstream().publish("crawl.seeds", b"https://b.example/2",
                                           headers={"Nats-Msg-Id": "b-seed-2"})
    assert ack.stream == streams.intake_stream(t.b.id).name
    assert not ack.duplicate
    got = await t.mesh.jetstream().get_msg(streams.intake_stream(t.b.id).name, ack.seq)
    assert got.data == b"https://b.example/2" and got.subject == subjects.seeds(t.b.id)
    after = await b_snapshot(t)
    assert after["INTAKE"]["messages"][:2] == t.b_before["INTAKE"]["messages"]
    assert len(after["INTAKE"]["messages"]) == 3
    assert after["RESULTS"] == t.b_before["RESULTS"]


async def test_a_cannot_learn_b_volume_from_intake_sequence_numbers(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        first = await a.js.publish("crawl.seeds", b"https://a.example/1")
        for n in range(5):  # B submits a lot in between
            await t.b_nc.jetstream().publish("crawl.seeds", f"https://b.example/x{n}".encode())
        second = await a.js.publish("crawl.seeds", b"https://a.example/2")
    # A's sequence numbers count A's seeds only (B had 2, then 7).
    assert (first.seq, second.seq) == (1, 2)
    assert first.stream == second.stream == streams.intake_stream(t.a.id).name
    assert await intake_count(t, t.b) == 7


async def test_a_cannot_roll_up_schedule_or_ttl_through_intake(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        with pytest.raises(ServerError) as refused:
            await a.js.publish("crawl.seeds", b"x", headers={"Nats-Rollup": "all"})
        assert (refused.value.err_code, refused.value.description) == (
            10111, "rollup not permitted")
        with pytest.raises(ServerError) as refused:
            await a.js.publish("crawl.seeds", b"x", headers={"Nats-Rollup": "sub"})
        assert refused.value.err_code == 10111
        with pytest.raises(BadRequestError) as refused:
            await a.js.publish("crawl.seeds", b"x", headers={"Nats-TTL": "1s"})
        assert (refused.value.err_code, refused.value.description) == (
            10166, "per-message TTL is disabled")
        # A schedule whose target is B's intake slot (the shared-stream hazard).
        with pytest.raises(BadRequestError) as refused:
            await a.js.publish("crawl.seeds", b"x", headers={
                "Nats-Schedule": "@at 2030-01-01T00:00:00Z",
                "Nats-Schedule-Target": subjects.seeds(t.b.id)})
        assert (refused.value.err_code, refused.value.description) == (
            10188, "message schedules is disabled")
    assert await intake_count(t, t.a) == 0
    await assert_b_intact(t)


async def test_a_cannot_purge_or_delete_in_streams_it_does_not_own(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        for stream in (streams.intake_stream(t.b.id).name, streams.intake_stream(t.a.id).name,
                       streams.PARKED.name, streams.LINKS.name):
            with pytest.raises(NotFoundError) as missing:
                await a.js.purge_stream(stream)
            assert missing.value.err_code == 10059
            with pytest.raises(NotFoundError) as missing:
                await a.js.delete_msg(stream, 1)
            assert missing.value.err_code == 10059
        # "RESULTS" for A is A's own RESULTS: purging it (allowed) touches only A's.
        assert await a.js.purge_stream(streams.RESULTS)
        # Roll-ups and TTLs into RESULTS: A may not publish there at all.
        await a.nc.publish("crawl.results.jobb", b"x",
                           headers={"Nats-Rollup": "all", "Nats-TTL": "1s"})
        await a.violation("crawl.results.jobb")
    await assert_b_intact(t)


async def test_a_cannot_forge_answers_to_mesh_requests_into_its_account(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    """MESH writes into A's RESULTS and reads its stream info through imports, and trusts
    the answers (PubAck, discard policy). A sees those requests but cannot answer them."""
    t = tenants
    async with attacker(settings, "a") as a:
        replies: list[str] = []

        async def forge(msg: Any) -> None:
            replies.append(msg.reply)
            fake = {"config": {"name": "RESULTS", "discard": "new"}} if "INFO" in msg.subject \
                else {"stream": "RESULTS", "seq": 999}
            await msg.respond(orjson.dumps(fake))

        await a.nc.subscribe("crawl.results.>", cb=forge)
        await a.nc.subscribe(f"$JS.API.STREAM.INFO.{streams.RESULTS}", cb=forge)
        await a.nc.flush()
        ack = await t.mesh.jetstream().publish(subjects.results(t.a.id, "joba"), b"page")
        assert (ack.stream, ack.seq) == (streams.RESULTS, 1)  # the real PubAck
        reply = await t.mesh.request(claims.stream_info_subject(t.a.id, streams.RESULTS), b"",
                                     timeout=2)
        assert orjson.loads(reply.data)["state"]["messages"] == 1  # the real stream info
        for _ in range(100):  # A's callbacks run on its own connection: may come after
            if len(replies) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(replies) == 2
        for subject in replies:
            await a.violation(subject)
    await assert_b_intact(t)


# ---- its own RESULTS -----------------------------------------------------------------------


async def test_a_cannot_update_or_delete_its_own_results_stream(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        before = (await a.js.stream_info(streams.RESULTS)).config
        unsafe = streams.tenant_stream_config(streams.RESULTS, settings, A_QUOTA.storage_bytes)
        unsafe.discard = "old"
        unsafe.allow_rollup_hdrs = True
        for stream in (streams.RESULTS, streams.EVENTS):
            unsafe.name = stream
            unsafe.subjects = [f"crawl.{stream.lower()}.>"]
            with pytest.raises(nats.errors.TimeoutError):
                await a.js.update_stream(unsafe)
            await a.violation(f"$JS.API.STREAM.UPDATE.{stream}")
            with pytest.raises(nats.errors.TimeoutError):
                await a.js.delete_stream(stream)
            await a.violation(f"$JS.API.STREAM.DELETE.{stream}")
            with pytest.raises(nats.errors.TimeoutError):
                await a.js.add_stream(unsafe)
            await a.violation(f"$JS.API.STREAM.CREATE.{stream}")
        unsafe.name, unsafe.subjects = streams.RESULTS, ["crawl.results.>"]
        # Restoring a snapshot over it is refused by the server (the name is in use).
        reply = await a.nc.request(f"$JS.API.STREAM.RESTORE.{streams.RESULTS}",
                                   orjson.dumps({"config": unsafe.as_dict()}), timeout=2)
        error = orjson.loads(reply.data)["error"]
        assert error["err_code"] == 10130, error  # stream name already in use
        after = (await a.js.stream_info(streams.RESULTS)).config
        assert after == before
        assert streams.tenant_stream_problem(after, streams.tenant_stream_config(
            streams.RESULTS, settings, A_QUOTA.storage_bytes)) is None
    await assert_b_intact(t)


# ---- quotas --------------------------------------------------------------------------------


async def test_a_cannot_exceed_its_storage_quota(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    mjs = t.mesh.jetstream()
    stored = 0
    with pytest.raises(APIError) as full:
        for n in range(100):  # 100 x 10 KiB > 256 KiB
            await mjs.publish(subjects.results(t.a.id, "joba"), b"y" * (10 << 10))
            stored = n + 1
    assert (full.value.err_code, full.value.description) == (10077, "maximum bytes exceeded")
    assert 0 < stored < 25
    async with TenantControl.open(settings) as control:
        usage = await control.usage("a")
    assert usage["storage_used_bytes"] <= A_QUOTA.storage_bytes
    assert usage["RESULTS"]["messages"] == stored
    # A's quota being full does not touch B: B's data is intact and B still gets results.
    await assert_b_intact(t)
    ack = await mjs.publish(subjects.results(t.b.id, "jobb"), b"b-after-a-full")
    assert ack.stream == streams.RESULTS and ack.seq == 4


async def test_a_cannot_create_streams_or_consumers_beyond_its_limits(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        with pytest.raises(APIError) as refused:
            await a.js.add_stream(name="MINE", subjects=["mine.>"], max_bytes=1024)
        assert (refused.value.err_code, refused.value.description) == (
            10027, "maximum number of streams reached")
        for durable in ("c1", "c2"):
            await a.js.add_consumer(streams.RESULTS, durable_name=durable)
        with pytest.raises(APIError) as refused:
            await a.js.add_consumer(streams.RESULTS, durable_name="c3")
        assert (refused.value.err_code, refused.value.description) == (
            10026, "maximum consumers limit reached")
        # nats-server applies the account's consumer limit per stream (JetStreamLimits
        # MaxConsumers): EVENTS has its own two, and ephemeral consumers count too.
        await a.js.add_consumer(streams.EVENTS, durable_name="e1")
        await a.js.add_consumer(streams.EVENTS)
        with pytest.raises(APIError) as refused:
            await a.js.add_consumer(streams.EVENTS)
        assert refused.value.err_code == 10026
        account = orjson.loads((await a.nc.request("$JS.API.INFO", b"", timeout=2)).data)
        assert account["consumers"] == A_QUOTA.max_streams * A_QUOTA.max_consumers
    # With a third stream allowed, RESULTS and EVENTS already reserve the whole quota.
    async with TenantControl.open(settings) as control:
        await control.update("a", max_streams=3)
    async with attacker(settings, "a") as a:
        with pytest.raises(APIError) as refused:
            await a.js.add_stream(name="MINE", subjects=["mine.>"], max_bytes=1024)
        assert (refused.value.err_code, refused.value.description) == (
            10047, "insufficient storage resources available")
        with pytest.raises(APIError) as refused:
            await a.js.add_stream(name="MINE", subjects=["mine.>"], storage="memory",
                                  max_bytes=1024)
        assert refused.value.err_code == 10028  # no memory storage at all
    await assert_b_intact(t)


# ---- suspend -------------------------------------------------------------------------------


async def test_a_cannot_keep_working_after_suspend(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    async with attacker(settings, "a") as a:
        await a.js.publish("crawl.seeds", b"https://a.example/before")
        async with TenantControl.open(settings) as control:
            await control.suspend("a")
        async with asyncio.timeout(WAIT_S):
            await a.closed.wait()
        assert str(a.nc.last_error) == "nats: user authentication revoked"
        with pytest.raises(nats.errors.ConnectionClosedError):
            await a.nc.publish("crawl.seeds", b"https://a.example/after")
    with pytest.raises(nats.errors.Error) as refused:
        await nats.connect(settings.nats_url, allow_reconnect=False, connect_timeout=2,
                           user_credentials=str(t.keys.tenant_creds("a")))
    assert str(refused.value) == "nats: 'Authorization Violation'"
    assert await intake_count(t, t.a) == 1
    # B is unaffected and keeps working.
    await assert_b_intact(t)
    ack = await t.b_nc.jetstream().publish("crawl.seeds", b"https://b.example/after")
    assert ack.stream == streams.intake_stream(t.b.id).name


# ---- forged imports (a control-plane bug) ---------------------------------------------------


def _forged_a_jwt(t: Tenants, extra_imports: list[dict[str, Any]]) -> str:
    """A's account JWT as crawlmesh issues it, plus ``extra_imports``, signed by the
    operator's signing key (as a control-plane bug would), newer than the current one."""
    account = claims.tenant_account_claims(
        t.a.id, t.a.name, t.a.quota, t.keys.key(f"{t.a.id}.signing").public_key,
        t.keys.key(MESH).public_key)
    account["nats"]["imports"] += extra_imports
    issued_at = int(decode(t.keys.jwt(t.a.id))["iat"]) + 1
    return encode(account, t.keys.key(OPERATOR_SIGNING), issued_at=issued_at)


async def _account_imports(sys_nc: Client, account: str) -> set[str]:
    """Local subjects of the imports the server actually holds for ``account``."""
    reply = await sys_nc.request(f"$SYS.REQ.ACCOUNT.{account}.INFO", b"", timeout=2)
    return {i["local_subject"] for i in orjson.loads(reply.data)["data"].get("imports") or []}


async def test_a_cannot_write_into_b_results_through_a_forged_import(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    a_key = t.keys.key(t.a.id)
    self_signed = encode(claims.activation_claims(t.a.id, "crawl.results.>", t.b.id), a_key)
    self_signed_info = encode(
        claims.activation_claims(t.a.id, "$JS.API.STREAM.INFO.RESULTS", t.b.id), a_key)
    forged = _forged_a_jwt(t, [
        {"name": "no-token", "subject": "crawl.results.>", "account": t.b.id,
         "type": "service", "local_subject": "steal.notoken.>"},
        {"name": "self-signed", "subject": "crawl.results.>", "account": t.b.id,
         "type": "service", "local_subject": "steal.selfsigned.>", "token": self_signed},
        {"name": "info", "subject": "$JS.API.STREAM.INFO.RESULTS", "account": t.b.id,
         "type": "service", "local_subject": "steal.info", "token": self_signed_info},
        # MESH's intake export has an account token position: only A's own slot.
        {"name": "b-intake", "subject": subjects.seeds(t.b.id), "account": t.keys.key(MESH).public_key,
         "type": "service", "local_subject": "steal.seeds"},
    ])
    sys_nc = await connect(settings, "sys", persistent=False, creds=t.keys.sys_creds)
    try:
        resolver = ClaimsResolver(sys_nc, t.keys.operator_keys)
        await resolver.push(forged)
        assert await resolver.lookup(t.a.id) == forged  # the server holds the forged JWT
        # ... but drops every forged import: only A's legitimate intake import is active.
        imports = await _account_imports(sys_nc, t.a.id)
        assert "crawl.seeds" in imports
        assert not {s for s in imports if s.startswith("steal.")}, imports
        async with TenantControl.open(settings) as control, \
                control.tenant_connection(t.a) as admin:
            for subject in ("steal.notoken.jobb", "steal.selfsigned.jobb", "steal.info",
                            "steal.seeds"):
                with pytest.raises(nats.errors.NoRespondersError):
                    await admin.request(subject, b"evil", timeout=2)
        await assert_b_intact(t)

        # Control: the same import with an activation token signed by B's signing key (what
        # crawlmesh issues to MESH alone) does work, so the refusals above are the tokens'.
        genuine = encode(claims.activation_claims(t.a.id, "crawl.results.>", t.b.id),
                         t.keys.key(f"{t.b.id}.signing"))
        t.keys.save_jwt(t.a.id, forged)
        control_jwt = _forged_a_jwt(t, [
            {"name": "genuine", "subject": "crawl.results.>", "account": t.b.id,
             "type": "service", "local_subject": "steal.genuine.>", "token": genuine}])
        await resolver.push(control_jwt)
        assert "steal.genuine.>" in await _account_imports(sys_nc, t.a.id)
        async with TenantControl.open(settings) as control, \
                control.tenant_connection(t.a) as admin:
            reply = await admin.request("steal.genuine.jobb", b"landed", timeout=2)
        assert orjson.loads(reply.data)["stream"] == streams.RESULTS
        assert len((await b_snapshot(t))["RESULTS"]["messages"]) == 4
    finally:
        await sys_nc.close()


# ---- JWT validation before the server ------------------------------------------------------


async def test_jwts_not_from_the_operator_or_not_newer_never_reach_the_server(
    settings: MeshSettings, tenants: Tenants,
) -> None:
    t = tenants
    current = t.keys.jwt(t.a.id)
    current_iat = int(decode(current)["iat"])
    richer = claims.tenant_account_claims(
        t.a.id, t.a.name, TenantQuota(storage_bytes=1 << 40, max_streams=1000),
        t.keys.key(f"{t.a.id}.signing").public_key, t.keys.key(MESH).public_key)
    signing = t.keys.key(OPERATOR_SIGNING)
    refused = {
        "rogue operator": encode(richer, KeyPair.create("O"), issued_at=current_iat + 10),
        "self-signed by the account": encode(richer, t.keys.key(t.a.id),
                                             issued_at=current_iat + 10),
        "signed by the account's signing key": encode(
            richer, t.keys.key(f"{t.a.id}.signing"), issued_at=current_iat + 10),
        "same issue time": encode(richer, signing, issued_at=current_iat),
        "older": encode(richer, signing, issued_at=current_iat - 60),
    }
    sys_nc = await connect(settings, "sys", persistent=False, creds=t.keys.sys_creds)
    try:
        pushed: list[bytes] = []

        async def on_update(msg: Any) -> None:
            pushed.append(msg.data)

        spy = await sys_nc.subscribe(UPDATE, cb=on_update)
        spy_account = await sys_nc.subscribe("$SYS.REQ.ACCOUNT.*.CLAIMS.UPDATE", cb=on_update)
        await sys_nc.flush()
        resolver = ClaimsResolver(sys_nc, t.keys.operator_keys)
        for label, token in refused.items():
            with pytest.raises(JwtError) as error:
                await resolver.push(token)
            if label in ("same issue time", "older"):
                assert "not after the current one" in str(error.value), label
            else:
                assert "not the operator or one of its signing keys" in str(error.value), label
        await sys_nc.flush()
        assert pushed == []  # nothing was sent on the update subjects
        assert await resolver.lookup(t.a.id) == current  # the server still has the old JWT
        # Control: a newer operator-signed JWT is pushed, and the spy sees it.
        newer = encode(richer, signing, issued_at=current_iat + 1)
        await resolver.push(newer)
        await sys_nc.flush()
        assert pushed == [newer.encode()]
        assert await resolver.lookup(t.a.id) == newer
        await spy.unsubscribe()
        await spy_account.unsubscribe()
    finally:
        await sys_nc.close()
    await assert_b_intact(t)
