"""``crawlmesh init``, ``up`` and ``service``: creating and running the mesh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from urllib.parse import urlsplit

import typer
from nats.aio.client import Client
from rich.console import Console

from shared.bus.connection import connect
from shared.bus.service import LoopSpec, run_service
from shared.launcher import SERVICES, EmbeddedMesh, MeshError, running_mesh
from shared.settings import MeshSettings
from shared.streams import ensure_mesh, ensure_tenant
from shared.tenancy import DEFAULT_TENANT, TenantRegistry

console = Console(stderr=True)


def _setups() -> dict[str, Callable[[Client, MeshSettings], Awaitable[Sequence[LoopSpec]]]]:
    from services.dedup.main import setup as dedup
    from services.fetcher.main import setup as fetcher
    from services.parser.main import setup as parser
    from services.seeder.main import setup as seeder
    from services.sink.main import setup as sink

    return {"seeder": seeder, "dedup": dedup, "fetcher": fetcher, "parser": parser, "sink": sink}


async def initialise(
    settings: MeshSettings, tenants: Sequence[str] = (DEFAULT_TENANT,)
) -> dict[str, str]:
    """Create or update every stream, consumer and bucket, and register ``tenants``.

    Returns ``{tenant name: tenant id}``. Idempotent.
    """
    nc = await connect(settings, name="crawlmesh-init")
    try:
        js = nc.jetstream()
        await ensure_mesh(js, settings)
        registry = TenantRegistry(js, settings.home)
        ids: dict[str, str] = {}
        for name in tenants:
            ids[name] = await registry.ensure(name)
            await ensure_tenant(js, ids[name], settings)
        return ids
    finally:
        await nc.close()


def init() -> None:
    """Create streams, consumers, KV buckets and the default tenant on the configured NATS."""
    settings = MeshSettings()
    ids = asyncio.run(initialise(settings))
    for name, tenant_id in ids.items():
        console.print(f"tenant [bold]{name}[/]: {tenant_id}")


def service(name: str = typer.Argument(..., help=f"One of: {', '.join(SERVICES)}")) -> None:
    """Run one service in the foreground (what `crawlmesh up` starts for each)."""
    setups = _setups()
    if name not in setups:
        raise typer.BadParameter(f"unknown service {name!r}; expected one of {', '.join(SERVICES)}")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - non-Linux
        pass
    asyncio.run(run_service(name, MeshSettings(), setups[name]))


def start_embedded(settings: MeshSettings) -> EmbeddedMesh:
    """Start nats-server, initialise streams and tenants, start the five services.

    Raises:
        MeshError: the server or the initialisation failed.
    """
    mesh = EmbeddedMesh(settings)
    url = mesh.start_server()
    try:
        asyncio.run(initialise(settings.model_copy(update={"nats_url": url})))
        mesh.start_services()
    except Exception:
        mesh.stop()
        raise
    return mesh


def _reachable(url: str) -> bool:
    """True if something accepts TCP connections at the first server of ``url``."""
    parts = urlsplit(url.split(",")[0].strip())
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), 1.0):
            return True
    except OSError:
        return False


def mesh_available(settings: MeshSettings) -> bool:
    """True if `crawlmesh up` runs from ``settings.home`` or NATS answers at its URL."""
    return running_mesh(settings.home) is not None or _reachable(settings.nats_url)


@contextlib.contextmanager
def ensure_mesh_running(settings: MeshSettings, allowed: bool = True) -> Iterator[MeshSettings]:
    """Yield settings pointing at a running mesh, starting an embedded one if needed.

    Order: a mesh started by `crawlmesh up` from ``settings.home``; else a NATS server
    already listening at ``settings.nats_url`` (e.g. docker compose); else, if ``allowed``,
    a new embedded mesh (`crawlmesh up` as a child process), stopped again on exit.

    Raises:
        typer.Exit: no mesh and not allowed to start one, or it failed to start.
    """
    state = running_mesh(settings.home)
    if state:
        yield settings.model_copy(update={"nats_url": str(state["url"])})
        return
    if _reachable(settings.nats_url):
        yield settings
        return
    if not allowed:
        console.print(f"no mesh running at {settings.nats_url}; start one with `crawlmesh up`")
        raise typer.Exit(1)
    console.print(f"starting the embedded mesh (state in {settings.home}, "
                  f"logs in {settings.home / 'logs'})")
    child = subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "up"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            state = running_mesh(settings.home)
            if state and state.get("pid") == child.pid:
                break
            if child.poll() is not None or time.monotonic() > deadline:
                err = (child.stderr.read() if child.stderr else b"").decode(errors="replace")
                console.print(f"[red]the embedded mesh did not start:[/] {err[-2000:]}")
                raise typer.Exit(1)
            time.sleep(0.1)
        yield settings.model_copy(update={"nats_url": str(state["url"])})
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()


def up() -> None:
    """Start the embedded mesh (nats-server + one process per service) until Ctrl-C."""
    settings = MeshSettings()
    if running_mesh(settings.home):
        console.print(f"a mesh is already running from {settings.home}")
        raise typer.Exit(1)
    try:
        mesh = start_embedded(settings)
    except MeshError as error:
        console.print(f"[red]could not start the mesh:[/] {error}")
        raise typer.Exit(1) from None
    console.print(f"mesh up: nats {mesh.url}, services {', '.join(SERVICES)}; "
                  f"state in {settings.home}; Ctrl-C stops")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            for name in mesh.supervise_once():
                console.print(f"restarted {name}")
    finally:
        console.print("stopping the mesh")
        mesh.stop()
    sys.exit(0)
