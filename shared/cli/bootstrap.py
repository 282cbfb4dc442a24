"""The steps of ``crawlmesh init`` that prepare a server running elsewhere (a container).

``crawlmesh init`` mints the operator, SYS and MESH once (:meth:`KeyStore.init_operator`),
writes the nats-server config, then (when NATS answers) creates the streams and tenants.
On a laptop the server runs beside the home folder; under ``docker compose`` it runs in
its own container, so init is told where the config goes and what the server listens on
(:class:`ServerPlan`), and copies the creds files the other containers need into their
volumes (:func:`export_creds`): the services get the MESH user's creds, never the keys.

With ``CRAWLMESH_REPLICAS`` above 1 the config is that of one server of a JetStream
cluster (nats-server "JetStream Clustering"): every server of the cluster reads the same
file, ``server_name`` comes from the ``$NATS_SERVER_NAME`` environment variable of each
server, and the routes list every server (a server ignores its route to itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from shared.accounts.keystore import KeyStore, write_private
from shared.natsserver import ClusterSpec, write_config
from shared.settings import MeshSettings

SERVER_NAME_ENV = "NATS_SERVER_NAME"
"""Environment variable of each cluster server that names it (unique, stable across restarts:
JetStream knows its peers by name)."""


class InitError(ValueError):
    """An option of ``crawlmesh init`` is invalid (the message says which and why)."""


def parse_listen(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::]:4222"`` for IPv6) as ``(host, port)``.

    Raises:
        InitError: not ``HOST:PORT`` with a port in 1..65535.
    """
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InitError(f"--listen takes HOST:PORT, not {text!r}")
    return host, int(port)


def parse_routes(text: str) -> tuple[str, ...]:
    """Comma-separated route URLs (``nats-route://HOST:PORT``) as a tuple.

    Raises:
        InitError: a URL without host and port, or of another scheme.
    """
    routes = tuple(part.strip() for part in text.split(",") if part.strip())
    for route in routes:
        parts = urlsplit(route)
        if parts.scheme not in ("nats-route", "nats") or not parts.hostname or not parts.port:
            raise InitError(f"--cluster-routes takes nats-route://HOST:PORT URLs, not {route!r}")
    return routes


@dataclass(frozen=True)
class ServerPlan:
    """Where the nats-server config goes and what the server it configures listens on.

    Attributes:
        config: path of the config file to write.
        host: client listen address (``0.0.0.0`` in a container).
        port: client port (4222).
        monitor_port: HTTP monitoring port (``/healthz``, ``/varz``; 8222), or None.
        routes: the cluster's route URLs; used only when ``replicas`` > 1.
        cluster_listen: ``host:port`` this server accepts routes on.
    """

    config: Path
    host: str
    port: int
    monitor_port: int | None = None
    routes: tuple[str, ...] = ()
    cluster_listen: str = "0.0.0.0:6222"

    @classmethod
    def from_options(cls, settings: MeshSettings, config: Path | None, listen: str | None,
                     monitor_port: int | None, routes: str) -> ServerPlan:
        """The plan from ``crawlmesh init``'s options; defaults: ``<home>/nats-server.conf``,
        listening on the first server of ``CRAWLMESH_NATS_URL``.

        Raises:
            InitError: an invalid ``listen`` or ``routes``.
        """
        if listen is not None:
            host, port = parse_listen(listen)
        else:
            parts = urlsplit(settings.nats_url.split(",")[0].strip())
            host, port = parts.hostname or "127.0.0.1", parts.port or 4222
        return cls(config=config or settings.home / "nats-server.conf", host=host, port=port,
                   monitor_port=monitor_port, routes=parse_routes(routes))

    def cluster(self, settings: MeshSettings) -> ClusterSpec | None:
        """The cluster block when ``settings.replicas`` > 1 and routes are known, else None."""
        if settings.replicas > 1 and self.routes:
            return ClusterSpec(routes=self.routes, listen=self.cluster_listen)
        return None

    def write(self, settings: MeshSettings, keys: KeyStore) -> Path:
        """Write the operator-mode config (operator JWT, SYS, the full resolver preloaded
        with SYS and MESH, JetStream in ``settings.store_dir``) and return its path.

        The JetStream store and the resolver folder are named by the paths they have in the
        crawlmesh home (``<home>/jetstream``, ``<home>/resolver``): a server in a container
        mounts its own volume at that path.
        """
        cluster = self.cluster(settings)
        return write_config(
            self.config, store_dir=settings.store_dir, host=self.host, port=self.port,
            http_port=self.monitor_port, extra=keys.server_config(),
            server_name=f"${SERVER_NAME_ENV}" if cluster else None, cluster=cluster,
        )


def export_creds(keys: KeyStore, mesh_out: Path | None, tenant_out: Path | None,
                 tenants: tuple[str, ...] = ()) -> list[Path]:
    """Copy the MESH user's creds to ``mesh_out`` and each of ``tenants``' creds to
    ``tenant_out/<name>.creds`` (mode 0600). Returns the files written.

    Raises:
        FileNotFoundError: a creds file is missing (the operator or tenant not minted yet).
    """
    written = []
    if mesh_out is not None:
        written.append(write_private(mesh_out, keys.mesh_creds.read_bytes()))
    if tenant_out is not None:
        for name in tenants:
            written.append(write_private(tenant_out / f"{name}.creds",
                                         keys.tenant_creds(name).read_bytes()))
    return written
