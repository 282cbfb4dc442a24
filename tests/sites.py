"""Small real HTTP sites on loopback for tests: a threaded server with a request log."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Route = Callable[[BaseHTTPRequestHandler], None]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def html(body: str, title: str = "") -> bytes:
    return f"<html><head><title>{title}</title></head><body>{body}</body></html>".encode()


@dataclass
class Site:
    """A loopback HTTP server serving ``pages`` (path -> (status, content type, body)) and
    ``routes`` (path -> custom handler); every request path is logged in ``requests``."""

    pages: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)
    host: str = "127.0.0.1"
    requests: list[str] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def base(self) -> str:
        assert self.server is not None
        return f"http://{self.host}:{self.server.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def start(self) -> Site:
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.requests.append(self.path)
                path = self.path.split("?")[0]
                if path in site.routes:
                    site.routes[path](self)
                    return
                status, ctype, body = site.pages.get(path, (404, "text/html", html("not found")))
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((self.host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def ring_site(pages: int, fanout: int) -> Site:
    """A started :class:`Site` of ``pages`` HTML pages ``/p0`` ... each linking to the
    ``fanout`` pages after ``7 * i`` (mod ``pages``), so all are reachable from ``/p0``; no
    robots.txt (404)."""
    site = Site()
    for i in range(pages):
        links = " ".join(f'<a href="/p{(i * 7 + k) % pages}">x</a>' for k in range(1, fanout + 1))
        site.pages[f"/p{i}"] = (200, "text/html", html(links, f"P{i}"))
    site.pages["/robots.txt"] = (404, "text/plain", b"")
    return site.start()


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until true; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
