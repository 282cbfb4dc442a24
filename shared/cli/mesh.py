"""``crawlmesh init``, ``up`` and ``service``: creating and running the mesh."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import nats
import typer
from nats.aio.client import Client
from rich.console import Console
from rich.markup import escape

from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.bus.service import Beside, LoopSpec, run_service
from shared.cli.bootstrap import InitError, ServerPlan, export_creds
from shared.launcher import (
    FETCHER_REPLICAS_ENV,
    SERVICES,
    EmbeddedMesh,
    MeshError,
    file_lock,
    running_mesh,
)
from shared.settings import MeshSettings, SettingsProblem, check_settings
from shared.streams import ensure_mesh
from shared.telemetry.logs import setup_logging
from shared.tenancy import DEFAULT_TENANT, TenantError, check_name

console = Console(stderr=True, soft_wrap=True)  # one message, one line (logs, grep)


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
    """Create or update every MESH stream, consumer and bucket, re-push MESH's JWT, and
    add ``tenants`` (accounts with RESULTS, EVENTS and a creds file) if missing.

    Returns ``{tenant name: tenant id}``. Idempotent.
    """
    nc = await connect(settings, name="crawlmesh-init", persistent=False)
    try:
        await ensure_mesh(nc.jetstream(), settings)
    finally:
        await nc.close()
    ids: dict[str, str] = {}
    async with TenantControl.open(settings) as control:
        await control.ensure_mesh_jwt()
        for name in tenants:
            ids[name] = (await control.ensure(name)).id
    return ids


def init(
    server_config: Path | None = typer.Option(
        None, "--server-config", help="Where to write the nats-server config "
        "(default: <home>/nats-server.conf)."),
    listen: str | None = typer.Option(
        None, "--listen", metavar="HOST:PORT", help="Client address in that config "
        "(default: the first server of CRAWLMESH_NATS_URL); 0.0.0.0:4222 in a container."),
    monitor_port: int | None = typer.Option(
        None, "--monitor-port", min=1, max=65535,
        help="HTTP monitoring port in that config (/healthz, /varz, /jsz)."),
    cluster_routes: str = typer.Option(
        "", "--cluster-routes", metavar="URLS",
        help="Comma-separated nats-route://HOST:PORT of every server of a JetStream cluster; "
        "used when CRAWLMESH_REPLICAS > 1 (each server names itself by $NATS_SERVER_NAME)."),
    offline: bool = typer.Option(
        False, "--offline", help="Only keys, JWTs, the config and creds files: do not "
        "contact NATS (the server is started with that config, then init runs again)."),
    wait_s: float = typer.Option(
        0.0, "--wait", min=0, metavar="SECONDS",
        help="Keep trying NATS this long (a server or cluster still starting); 0: try once."),
    tenants: list[str] = typer.Option(
        [], "--tenant", help="Another tenant to create if missing (repeatable; "
        f"'{DEFAULT_TENANT}' always is)."),
    mesh_creds_out: Path | None = typer.Option(
        None, "--mesh-creds-out", help="Also copy the MESH user's creds file here "
        "(what the services connect with; they need no keys)."),
    tenant_creds_out: Path | None = typer.Option(
        None, "--tenant-creds-out", help="Also copy each tenant's creds file into this "
        "folder as NAME.creds."),
) -> None:
    """Mint the operator, SYS and MESH keys and JWTs (once) and write the nats-server
    config; then, if NATS answers, create streams, consumers, buckets and the default tenant.
    Idempotent: run it again after any change of settings (replicas, limits)."""
    settings = MeshSettings()
    names = tuple(dict.fromkeys((DEFAULT_TENANT, *tenants)))
    try:
        for name in names:
            check_name(name)
        plan = ServerPlan.from_options(settings, server_config, listen, monitor_port,
                                       cluster_routes)
    except (InitError, TenantError) as error:
        raise typer.BadParameter(str(error)) from None
    keys = KeyStore(settings.home)
    keys.init_operator()
    config = plan.write(settings, keys)
    export_creds(keys, mesh_creds_out, None)
    cluster = plan.cluster(settings)
    console.print(f"operator keys and JWTs in {settings.home}; nats-server config: {config}"
                  + (f" (cluster: {', '.join(cluster.routes)})" if cluster else ""))
    if settings.replicas > 1 and cluster is None:
        console.print(f"CRAWLMESH_REPLICAS={settings.replicas} needs a JetStream cluster; "
                      "the config written is for a single server (see --cluster-routes)")
    if offline:
        return
    if not wait_s and not _reachable(settings.nats_url):
        console.print(f"no NATS at {settings.nats_url}: start nats-server with that config "
                      "(or `crawlmesh up`), then run `crawlmesh init` again")
        return
    try:
        ids = asyncio.run(_initialise_within(settings, names, wait_s))
    except (nats.errors.NoServersError, OSError) as error:
        _say(f"[red]cannot reach NATS at {settings.nats_url}:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    except Exception as error:
        _say(f"[red]could not initialise the mesh at {settings.nats_url}:[/] "
             f"{escape(repr(error))}")
        raise typer.Exit(1) from None
    plan.write(settings, keys)  # preload MESH's JWT as it is now (with the tenants' imports)
    export_creds(keys, mesh_creds_out, tenant_creds_out, names)
    for name, tenant_id in ids.items():
        creds = tenant_creds_out / f"{name}.creds" if tenant_creds_out else keys.tenant_creds(name)
        console.print(f"tenant [bold]{name}[/]: {tenant_id} (creds: {creds})")


async def _initialise_within(settings: MeshSettings, tenants: Sequence[str],
                             wait_s: float) -> dict[str, str]:
    """:func:`initialise`, tried again every 2 s for up to ``wait_s`` seconds while it fails
    (no server yet, a cluster without a JetStream leader or short of peers for R3 streams).

    Raises:
        Exception: the last failure, once ``wait_s`` has passed.
    """
    deadline = time.monotonic() + wait_s
    said = 0.0
    while True:
        try:
            return await initialise(settings, tenants)
        except Exception as error:
            now = time.monotonic()
            if now >= deadline:
                raise
            if now - said >= 10:
                said = now
                _say(f"waiting for NATS at {settings.nats_url} ({deadline - now:.0f} s left): "
                     f"{escape(str(error) or repr(error))}")
            await asyncio.sleep(2.0)


def service(name: str = typer.Argument(..., help=f"One of: {', '.join(SERVICES)}")) -> None:
    """Run one service in the foreground (what `crawlmesh up` starts for each)."""
    setups = _setups()
    if name not in setups:
        raise typer.BadParameter(f"unknown service {name!r}; expected one of {', '.join(SERVICES)}")
    check_settings()  # before connecting: a bad value is one line and exit 2 (see main)
    setup_logging(name)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - non-Linux
        pass
    asyncio.run(run_service(name, MeshSettings(), setups[name], beside=_beside(name)))


def _beside(name: str) -> Sequence[Beside]:
    """Tasks service ``name`` runs beside its loops (the sink: the JetStream gauges; the
    fetcher: its partition loops, which follow its leases)."""
    from services.fetcher.main import BESIDE as fetcher
    from services.sink.main import BESIDE as sink

    return {"sink": sink, "fetcher": fetcher}.get(name, ())


def start_embedded(settings: MeshSettings, auto: bool = False) -> EmbeddedMesh:
    """Start nats-server, initialise streams and tenants, start the five services.

    Raises:
        MeshError: a setting of a service is invalid, or the server or the initialisation
            failed.
    """
    try:
        check_settings()  # a service with a bad setting would only fail in its own log
    except SettingsProblem as problem:
        raise MeshError(f"invalid setting: {problem}") from None
    mesh = EmbeddedMesh(settings)
    url = mesh.start_server()
    try:
        asyncio.run(initialise(settings.model_copy(update={"nats_url": url})))
        mesh.start_services(auto)
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


def _say(message: str) -> None:
    """Print to stderr, ignoring a closed terminal (SIGHUP) so shutdown still runs."""
    with contextlib.suppress(OSError, ValueError):
        console.print(message)


def _lock_path(home: Path, name: str) -> Path:
    return home / f"{name}.lock"


@contextlib.contextmanager
def ensure_mesh_running(settings: MeshSettings, allowed: bool = True) -> Iterator[MeshSettings]:
    """Yield settings pointing at a running mesh, starting an embedded one if needed.

    Order: a mesh started by `crawlmesh up` from ``settings.home``; else a NATS server
    already listening at ``settings.nats_url`` (e.g. docker compose); else, if ``allowed``,
    a new embedded mesh (`crawlmesh up --auto`). Concurrent callers share one embedded
    mesh: each holds a shared lock on ``<home>/users.lock`` while using it, startup is
    serialised by ``<home>/start.lock``, and the last user of an ``--auto`` mesh stops it.

    Raises:
        typer.Exit: no mesh and not allowed to start one, or it failed to start.
    """
    users = _lock_path(settings.home, "users")
    state: dict[str, object] | None = None
    try:
        with file_lock(users, fcntl.LOCK_SH):
            with file_lock(_lock_path(settings.home, "start"), fcntl.LOCK_EX):
                state = running_mesh(settings.home)
                if state is None and not _reachable(settings.nats_url):
                    if not allowed:
                        _say(f"no mesh running at {settings.nats_url}; "
                             "start one with `crawlmesh up`")
                        raise typer.Exit(1)
                    state = _start_auto_mesh(settings)
            url = str(state["url"]) if state else settings.nats_url
            yield settings.model_copy(update={"nats_url": url})
    finally:
        if state and state.get("auto"):
            with file_lock(users, fcntl.LOCK_EX, blocking=False) as last:
                if last:  # nobody else uses the auto-started mesh: stop it
                    _say("stopping the embedded mesh")
                    _stop_mesh(settings.home, int(str(state["pid"])))


def _start_auto_mesh(settings: MeshSettings) -> dict[str, object]:
    _say(f"starting the embedded mesh (state in {settings.home}, logs in "
         f"{settings.home / 'logs'})")
    child = subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "up", "--auto"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    try:
        while True:
            state = running_mesh(settings.home)
            if state and state.get("pid") == child.pid:
                return state
            if child.poll() is not None or time.monotonic() > deadline:
                err = (child.stderr.read() if child.stderr else b"").decode(errors="replace")
                _say(f"[red]the embedded mesh did not start:[/] {escape(err[-2000:])}")
                raise typer.Exit(1)
            time.sleep(0.1)
    except BaseException:  # interrupted or failed while starting: take it down again
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
        raise


def _stop_mesh(home: Path, pid: int, timeout_s: float = 60) -> None:
    """SIGTERM the launcher ``pid`` and wait until it has stopped everything."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while running_mesh(home) and time.monotonic() < deadline:
        time.sleep(0.1)


def up(
    auto: bool = typer.Option(False, "--auto", hidden=True,
                              help="Started by `crawl`: its last user stops it."),
    fetchers: int = typer.Option(
        0, "--fetchers", min=0,
        help="Fetcher processes to run (they share the frontier partitions); "
        "default: CRAWLMESH_FETCHER_REPLICAS or 1."),
) -> None:
    """Start the embedded mesh (nats-server + one process per service) until Ctrl-C."""
    if fetchers:
        os.environ[FETCHER_REPLICAS_ENV] = str(fetchers)
    settings = MeshSettings()
    with file_lock(_lock_path(settings.home, "mesh"), fcntl.LOCK_EX, blocking=False) as mine:
        if not mine or running_mesh(settings.home):
            _say(f"a mesh is already running from {settings.home}")
            raise typer.Exit(1)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.set())
        try:
            mesh = start_embedded(settings, auto)
        except (MeshError, OSError) as error:
            _say(f"[red]could not start the mesh:[/] {escape(str(error))}")
            raise typer.Exit(1) from None
        _say(f"mesh up: nats {mesh.url}, services {', '.join(SERVICES)}; "
             f"state in {settings.home}; Ctrl-C stops")
        if metrics := mesh.metrics_urls():
            _say("metrics: " + ", ".join(f"{name} {url}/metrics" for name, url in metrics.items()))
        try:
            while not stop.wait(0.5):
                for name in mesh.supervise_once():
                    _say(f"restarted {name}")
        finally:
            _say("stopping the mesh")
            mesh.stop()
    sys.exit(0)
