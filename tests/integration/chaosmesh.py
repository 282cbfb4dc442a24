"""The embedded mesh under faults: kill services, kill and restart nats-server, retire replicas.

:class:`ChaosMesh` runs :class:`shared.launcher.EmbeddedMesh` (what `crawlmesh up` runs:
nats-server with JetStream file storage in ``<home>/jetstream``, operator mode, one
process per service replica, a crashed child restarted with backoff) inside the calling
process, so the chaos suite can do what `crawlmesh up` does not expose:

- :meth:`ChaosMesh.kill`: SIGKILL one live process of a service (the launcher restarts it);
- :meth:`ChaosMesh.retire`: SIGKILL one replica and never restart it;
- :meth:`ChaosMesh.restart_server`: SIGKILL nats-server, keep it down a while, start it again
  on the same port and store (as a supervisor would).

Every child process is started by one owner thread (services get
``PR_SET_PDEATHSIG``, which fires when the *thread* that forked them ends), which also
supervises (restarts dead services every 0.2 s). Other threads hand it work through
:meth:`ChaosMesh.call`.

It also reads what the checks need from the MESH account: dead letters of a job
(:func:`dead_letters`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import queue
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect
from shared.cli.mesh import initialise
from shared.codec import decode
from shared.contracts.results import DeadLetter
from shared.launcher import Child, EmbeddedMesh
from shared.settings import MeshSettings
from shared.streams import DLQ
from shared.tenancy import DEFAULT_TENANT
from tests.sites import free_port

T = TypeVar("T")

CHAOS_ENV: dict[str, str] = {
    "CRAWLMESH_MAX_DELIVER": "8",
    "CRAWLMESH_BACKOFF_S": "1,1,1,2",
    "CRAWLMESH_FETCHER_ACK_WAIT_S": "1",
    "CRAWLMESH_FETCHER_HOST_DELAYS": '{"127.0.*": 0}',
    "CRAWLMESH_FETCHER_LEASE_S": "1.5",
    "CRAWLMESH_SHUTDOWN_GRACE_S": "3",
    "CRAWLMESH_METRICS_BASE_PORT": "0",
    "CRAWLMESH_NATS_CONNECT_TIMEOUT_S": "2",
}
"""Settings of a chaos run: a redelivery horizon that random kills and server restarts do
not exhaust for a healthy message (8 deliveries, so only a poison message is dead-lettered),
redeliveries and partition take-overs within seconds, no metrics endpoints."""


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored after (settings read from the env)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Mesh(EmbeddedMesh):
    """The launcher's mesh with extra environment for its children."""

    extra_env: dict[str, str] = {}

    def child_env(self) -> dict[str, str]:
        return {**super().child_env(), **self.extra_env}


@dataclass
class ChaosMesh:
    """An embedded mesh with faults on demand (see module docstring).

    Attributes:
        home: state folder (server config, store, keys, logs).
        env: ``CRAWLMESH_*`` settings for the launcher and every child (over
            :data:`CHAOS_ENV`).
        replicas: processes per service (default one each).
        rng: where random choices come from (the run's seed).
        kills: SIGKILLs done, by service name, plus ``nats-server``.
    """

    home: Path
    env: dict[str, str] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)
    rng: random.Random = field(default_factory=random.Random)
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    settings: MeshSettings | None = None
    tenant_id: str = ""
    """Id of the ``default`` tenant (the token in its subjects)."""
    mesh: _Mesh | None = None
    _work: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = field(
        default_factory=queue.Queue)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _retired: list[Child] = field(default_factory=list)

    # ---- life cycle -------------------------------------------------------------------------

    def start(self) -> ChaosMesh:
        """Start nats-server, create streams and the ``default`` tenant, start the services.

        Raises:
            shared.launcher.MeshError: the server did not start.
        """
        port = free_port()
        self.env = {**CHAOS_ENV, **self.env, "CRAWLMESH_HOME": str(self.home),
                    "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{port}"}
        with environ(self.env):
            self.settings = MeshSettings()
        self._thread = threading.Thread(target=self._own, name="chaos-mesh", daemon=True)
        self._thread.start()
        try:
            self.call(self._boot)
        except BaseException:
            self.stop()
            raise
        return self

    def _boot(self) -> None:
        assert self.settings is not None
        mesh = _Mesh(self.settings, replicas=dict(self.replicas))
        mesh.extra_env = self.env
        self.mesh = mesh
        url = mesh.start_server()
        with environ(self.env):
            ids = asyncio.run(initialise(self.settings.model_copy(update={"nats_url": url})))
        self.tenant_id = ids[DEFAULT_TENANT]
        mesh.start_services()

    def stop(self) -> None:
        """Stop the services (SIGTERM, they drain) and the server; end the owner thread."""
        if self._thread is None:
            return
        with contextlib.suppress(Exception):
            if self.mesh is not None:
                self.call(self.mesh.stop, timeout_s=90)
        self._stopping.set()
        self._thread.join(30)
        self._thread = None
        for child in self._retired:  # killed already; reap
            if child.process is not None:
                child.process.wait()

    def call(self, work: Callable[[], T], timeout_s: float = 120) -> T:
        """Run ``work`` on the owner thread; return its result (or raise its error)."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._work.put((work, done))
        return done.result(timeout_s)

    def _own(self) -> None:
        while not self._stopping.is_set():
            try:
                work, done = self._work.get(timeout=0.2)
            except queue.Empty:
                pass
            else:
                try:
                    done.set_result(work())
                except BaseException as error:  # handed to the caller
                    done.set_exception(error)
            if self.mesh is not None and self.mesh.children and not self._stopping.is_set():
                self.mesh.supervise_once()

    # ---- faults -------------------------------------------------------------------------------

    def live(self, kind: str) -> list[Child]:
        """Running processes of service ``kind`` (replicas included)."""
        assert self.mesh is not None
        return [c for c in self.mesh.children if c.name.split("#")[0] == kind
                and c.process is not None and c.process.poll() is None]

    def wait_live(self, kind: str, count: int = 1, timeout_s: float = 60) -> list[Child]:
        """Wait until ``count`` processes of ``kind`` run (restarts take 2, 4, 8 ... s)."""
        deadline = time.monotonic() + timeout_s
        while len(live := self.live(kind)) < max(count, 1):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {count} running {kind} processes after {timeout_s}s")
            time.sleep(0.05)
        return live

    def kill(self, kind: str) -> int:
        """SIGKILL one running process of ``kind`` (random among replicas); the launcher
        restarts it. Returns its pid."""
        child = self.rng.choice(self.wait_live(kind))
        assert child.process is not None
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait(30)  # gone (and reaped) before anyone looks for live ones again
        self.kills[kind] += 1
        return child.process.pid

    def kill_pid(self, pid: int, kind: str) -> None:
        """SIGKILL process ``pid`` (a service the caller picked, e.g. holding a message)."""
        os.kill(pid, signal.SIGKILL)
        self.kills[kind] += 1

    def pids(self, kind: str) -> list[int]:
        return [c.process.pid for c in self.live(kind) if c.process is not None]

    def retire(self, kind: str) -> str:
        """SIGKILL one replica of ``kind`` for good (never restarted). Returns its name."""

        def take_out() -> str | None:
            assert self.mesh is not None
            live = self.live(kind)
            if len(live) < 2:
                return None  # one is being restarted: wait for it again
            child = self.rng.choice(live)
            self.mesh.children.remove(child)
            assert child.process is not None
            os.kill(child.process.pid, signal.SIGKILL)
            self._retired.append(child)
            return child.name

        while True:  # both replicas running (one may be restarting after a kill)
            self.wait_live(kind, 2)
            if (name := self.call(take_out)) is not None:
                break
        self.kills[f"{kind} (for good)"] += 1
        return name

    def restart_server(self, down_s: float) -> None:
        """SIGKILL nats-server, leave it down ``down_s`` seconds, start it again (same port,
        same JetStream file store)."""
        assert self.mesh is not None and self.mesh.server is not None
        server = self.mesh.server
        self.call(server.kill)
        self.kills["nats-server"] += 1
        time.sleep(down_s)  # the outage itself: what the services must ride out
        self.call(server.start)

    # ---- reading the mesh ---------------------------------------------------------------------

    async def connect_tenant(self, name: str = "chaos-tenant") -> Client:
        """A connection as the ``default`` tenant's user that reconnects forever."""
        assert self.settings is not None
        return await connect(self.settings, name,
                             creds=KeyStore(self.home).tenant_creds(DEFAULT_TENANT))

    async def connect_mesh(self, name: str = "chaos-mesh") -> Client:
        """A MESH connection (reads dead letters) that reconnects forever."""
        assert self.settings is not None
        return await connect(self.settings, name)

    def log(self, name: str) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


async def dead_letters(nc: Client, tenant: str, job: str) -> list[DeadLetter]:
    """Every dead letter of ``job`` (``mesh.dlq.*.<tenant>.<job>`` in ``DLQ``), MESH ``nc``."""
    js = nc.jetstream()
    info = await js.stream_info(DLQ.name, subjects_filter=f"mesh.dlq.*.{tenant}.{job}")
    if not info.state.subjects:
        return []
    sub = await js.pull_subscribe(
        f"mesh.dlq.*.{tenant}.{job}", durable=None, stream=DLQ.name,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                              inactive_threshold=30.0))
    out: list[DeadLetter] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                break
            out += [decode(msg.data, DeadLetter) for msg in msgs]
            if msgs[-1].metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out
