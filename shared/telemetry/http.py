"""A service process's own HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

- ``GET /metrics``: every metric of the process (``prometheus_client``'s default registry),
  in the exposition format the scraper's ``Accept`` header asks for (Prometheus text
  0.0.4 or OpenMetrics).
- ``GET /healthz``: ``200 ok`` while the process is alive (its event loop answers).
- ``GET /readyz``: ``200 ready`` when the readiness check returns None (for a service:
  connected to NATS, and its streams and consumers exist); otherwise ``503`` with the
  reason as a one-line body.

It runs on the service's own asyncio loop, so a wedged loop fails the probes as well. The
HTTP is minimal: HTTP/1.1 answers, one request per connection (``Connection: close``),
``GET`` and ``HEAD`` only. The port comes from ``MeshSettings.metrics_port`` (0: none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

Readiness = Callable[[], Awaitable[str | None]]
"""Returns None when ready, else why not (a short sentence)."""

REQUEST_TIMEOUT_S = 5.0
"""How long a client may take to send its request line and headers, seconds."""

MAX_HEADER_LINES = 100


async def _always_ready() -> str | None:
    return None


class TelemetryServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (see module doc).

    Args:
        host: address to listen on (``127.0.0.1`` by default in settings).
        port: TCP port; 0 picks a free one (see :attr:`port` after :meth:`start`).
        readiness: the ``/readyz`` check.
    """

    def __init__(self, host: str, port: int, readiness: Readiness = _always_ready) -> None:
        self.host = host
        self.port = port
        self.readiness = readiness
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> TelemetryServer:
        """Listen; afterwards :attr:`port` is the bound port.

        Raises:
            OSError: the address cannot be bound (e.g. the port is taken).
        """
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        """Stop listening (requests in progress are dropped)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                method, path, headers = await _read_request(reader)
            status, content_type, body = await self._answer(method, path, headers)
            head = (
                f"HTTP/1.1 {status.value} {status.phrase}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ValueError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a slow, malformed or vanished client: just hang up
        except Exception:  # never let a bad request take anything else down
            log.exception("telemetry endpoint failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, method: str, path: str,
                      headers: dict[str, str]) -> tuple[HTTPStatus, str, bytes]:
        text = "text/plain; charset=utf-8"
        if method not in ("GET", "HEAD"):
            return HTTPStatus.METHOD_NOT_ALLOWED, text, b"GET or HEAD only\n"
        if path == "/metrics":
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            return HTTPStatus.OK, content_type, encoder(REGISTRY)
        if path == "/healthz":
            return HTTPStatus.OK, text, b"ok\n"
        if path == "/readyz":
            try:
                reason = await self.readiness()
            except Exception as error:
                reason = f"readiness check failed: {error!r}"
            if reason is None:
                return HTTPStatus.OK, text, b"ready\n"
            return HTTPStatus.SERVICE_UNAVAILABLE, text, f"not ready: {reason}\n".encode()
        return HTTPStatus.NOT_FOUND, text, b"try /metrics, /healthz or /readyz\n"


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    """``(method, path without query, lower-cased headers)`` of one HTTP/1.x request.

    Raises:
        ValueError: not an HTTP request line, or too many header lines.
    """
    method, target, _version = (await reader.readline()).decode("latin-1").split()
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = (await reader.readline()).decode("latin-1").strip()
        if not line:
            return method.upper(), target.split("?", 1)[0], headers
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    raise ValueError("too many header lines")


async def start_endpoint(host: str, port: int, readiness: Readiness) -> TelemetryServer | None:
    """Start a :class:`TelemetryServer` on ``host:port``; None if ``port`` is 0 or taken.

    A port that cannot be bound is logged and the service runs without the endpoint (two
    meshes on one machine must not stop each other's services).
    """
    if port == 0:
        return None
    try:
        server = await TelemetryServer(host, port, readiness).start()
    except OSError as error:
        log.error("no metrics endpoint: cannot listen on %s:%d: %s", host, port, error)
        return None
    log.info("metrics on %s/metrics (health: /healthz, /readyz)", server.url)
    return server
