"""The embedded mesh (`crawlmesh up`) as a child process for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from shared.settings import MeshSettings
from tests.sites import free_port, wait_for

TEST_ENV = {
    "CRAWLMESH_MAX_DELIVER": "3",
    "CRAWLMESH_BACKOFF_S": "1,1,1",
    "CRAWLMESH_FETCHER_ACK_WAIT_S": "1",
    "CRAWLMESH_FETCHER_HOST_DELAYS": '{"127.0.0.*": 0}',
}


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports that were all free a moment ago, below
    the ephemeral range (so outgoing connections do not take them meanwhile)."""
    for _ in range(200):
        base = random.randrange(20000, 30000 - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError(f"no {count} consecutive free ports on {host}")


@dataclass
class MeshProcess:
    """`crawlmesh up` started with its own home folder, NATS port and metrics ports (a
    free range, so meshes of tests running at once do not collide)."""

    home: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    port: int = 0
    _killed: set[int] = field(default_factory=set)

    def start(self) -> MeshProcess:
        self.port = free_port()
        self.env = {**os.environ, **TEST_ENV, **self.env,
                    "CRAWLMESH_HOME": str(self.home),
                    "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{self.port}"}
        self.env.setdefault("CRAWLMESH_METRICS_BASE_PORT", str(free_port_range(10)))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shared.cli.main", "up"], env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        state = self.home / "mesh.json"

        def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                out = self.process.stdout.read().decode() if self.process.stdout else ""
                raise AssertionError(f"crawlmesh up exited: {out}")
            try:
                return json.loads(state.read_text())["pid"] == self.process.pid
            except (FileNotFoundError, json.JSONDecodeError):  # not yet, or being written
                return False

        try:
            wait_for(ready, 60, "the embedded mesh")
        except BaseException:  # never leave a half-started mesh behind
            self.stop()
            raise
        return self

    @property
    def metrics(self) -> dict[str, str]:
        """``{process name: "http://host:port"}`` of each service's metrics endpoint."""
        return dict(json.loads((self.home / "mesh.json").read_text()).get("metrics", {}))

    @property
    def settings(self) -> MeshSettings:
        return MeshSettings(home=self.home, nats_url=f"nats://127.0.0.1:{self.port}",
                            max_deliver=3, backoff_s=(1.0, 1.0, 1.0))

    def service_pids(self, name: str) -> list[int]:
        assert self.process is not None
        pids = []
        for child in psutil.Process(self.process.pid).children():
            try:
                if child.cmdline()[-2:] == ["service", name]:
                    pids.append(child.pid)
            except psutil.Error:  # exited or a zombie not reaped yet
                continue
        return pids

    def kill_service(self, name: str) -> int:
        """SIGKILL the service ``name`` (waiting for the launcher to have restarted it after an
        earlier kill). Returns the killed pid."""
        wait_for(lambda: bool(self._live(name)), 30, f"a running {name} process")
        pid = self._live(name)[0]
        os.kill(pid, signal.SIGKILL)
        self._killed.add(pid)
        return pid

    def _live(self, name: str) -> list[int]:
        return [pid for pid in self.service_pids(name) if pid not in self._killed]

    def stop(self) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
        return self.process.returncode

    def log(self, name: str) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""
