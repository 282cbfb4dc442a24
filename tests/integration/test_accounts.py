"""Operator mode end to end at the NATS level: a tenant account added at run time can
publish seeds into its own intake slot, and MESH writes into the tenant's RESULTS and
EVENTS through the activation-token imports and gets a real PubAck."""

from __future__ import annotations

import stat

import orjson
from nats.aio.client import Client

from shared import subjects
from shared.accounts import claims
from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.settings import MeshSettings
from shared.streams import intake_stream


async def test_tenant_seed_reaches_its_intake_and_results_reach_the_tenant(
    settings: MeshSettings, tenant: str, nc: Client,
) -> None:
    keys = KeyStore(settings.home)
    creds = keys.tenant_creds("test")
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert stat.S_IMODE((settings.home / "keys" / f"{tenant}.nk").stat().st_mode) == 0o600
    tenant_nc = await connect(settings, "tenant", persistent=False, creds=creds)
    try:
        tjs = tenant_nc.jetstream()
        ack = await tjs.publish("crawl.seeds", b"https://example.org/")
        assert ack.stream == intake_stream(tenant).name
        js = nc.jetstream()
        got = await js.get_last_msg(intake_stream(tenant).name, subjects.seeds(tenant))
        assert got.data == b"https://example.org/"

        ack = await js.publish(subjects.results(tenant, "job1"), b'{"r": 1}')
        assert ack.stream == "RESULTS"
        ack = await js.publish(subjects.events(tenant, "job1"), b'{"e": 1}')
        assert ack.stream == "EVENTS"
        msg = await tjs.get_last_msg("RESULTS", "crawl.results.job1")
        assert msg.data == b'{"r": 1}'

        reply = await nc.request(claims.stream_info_subject(tenant, "RESULTS"), b"", timeout=5)
        assert orjson.loads(reply.data)["config"]["discard"] == "new"
    finally:
        await tenant_nc.close()


async def test_usage_reports_storage(settings: MeshSettings, tenant: str, nc: Client) -> None:
    await nc.jetstream().publish(subjects.results(tenant, "j"), b"x" * 1000)
    async with TenantControl.open(settings) as control:
        usage = await control.usage("test")
    assert usage["RESULTS"]["messages"] == 1
    assert usage["storage_used_bytes"] >= 1000
