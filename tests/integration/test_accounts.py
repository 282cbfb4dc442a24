"""Operator mode end to end at the NATS level: a tenant account added at run time can
publish seeds into its own intake slot, and MESH writes into the tenant's RESULTS and
EVENTS through the activation-token imports and gets a real PubAck."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys

import orjson
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from services.seeder.main import setup as seeder_setup
from shared import subjects
from shared.accounts import claims
from shared.accounts.control import TenantControl
from shared.accounts.jwt import decode
from shared.accounts.keystore import KeyStore
from shared.accounts.resolver import ClaimsResolver
from shared.bus.connection import connect
from shared.bus.service import run_service
from shared.settings import MeshSettings
from shared.streams import intake_stream
from shared.tenancy import TenantRegistry


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


async def test_intake_is_durable_while_the_seeder_is_down(
    settings: MeshSettings, tenant: str, nc: Client,
) -> None:
    """A seed published while no seeder runs waits in the tenant's intake stream and starts
    its job when the seeder comes up."""
    creds = KeyStore(settings.home).tenant_creds("test")
    tenant_nc = await connect(settings, "tenant", persistent=False, creds=creds)
    try:
        request = {"seeds": ["http://127.0.0.1:9/"], "job_id": "durable1", "max_depth": 0}
        await tenant_nc.jetstream().publish("crawl.seeds", orjson.dumps(request))
        info = await nc.jetstream().stream_info(intake_stream(tenant).name)
        assert info.state.messages == 1  # stored, nobody consuming yet

        stop = asyncio.Event()
        seeder = asyncio.create_task(run_service("seeder", settings, seeder_setup, stop))
        try:
            started = await wait_for_event(tenant_nc, "durable1", "started", timeout_s=20)
            assert started["tenant"] == tenant
        finally:
            stop.set()
            await asyncio.wait_for(seeder, 30)
    finally:
        await tenant_nc.close()


async def wait_for_event(nc: Client, job: str, kind: str, timeout_s: float) -> dict:
    js = nc.jetstream()
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            msg = await js.get_last_msg("EVENTS", f"crawl.events.{job}")
            event = orjson.loads(msg.data)
            if event["kind"] == kind:
                return event
        except NotFoundError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {kind} event for job {job} within {timeout_s} s")


def test_concurrent_tenant_commands_lose_no_change(
    settings: MeshSettings, tenant: str, child_env: dict[str, str],
) -> None:
    """Four `crawlmesh tenant add` at once: each serialises its change to MESH's JWT under
    the control lock, so MESH ends up importing from all four (none overwrote another)."""
    env = {**child_env, "CRAWLMESH_HOME": str(settings.home)}
    names = ["t1", "t2", "t3", "t4"]
    procs = [subprocess.Popen([sys.executable, "-m", "shared.cli.main", "tenant", "add", name],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in names]
    for proc in procs:
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err.decode()

    async def check() -> None:
        mesh_nc = await connect(settings, "check", persistent=False)
        sys_nc = await connect(settings, "check-sys", persistent=False,
                               creds=KeyStore(settings.home).sys_creds)
        try:
            ids = await TenantRegistry(mesh_nc.jetstream()).all()
            token = await ClaimsResolver(sys_nc, KeyStore(settings.home).operator_keys).lookup(
                KeyStore(settings.home).key("MESH").public_key)
            assert token is not None
            imported = {imp["account"] for imp in decode(token)["nats"]["imports"]}
            assert {ids[name] for name in names} | {tenant} <= imported
            for name in names:  # and the imports work: MESH's write lands in each RESULTS
                ack = await mesh_nc.jetstream().publish(subjects.results(ids[name], "j"), b"{}")
                assert ack.stream == "RESULTS"
        finally:
            await sys_nc.close()
            await mesh_nc.close()

    asyncio.run(check())
