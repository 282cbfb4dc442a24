"""Connecting to NATS with the mesh settings (URL, optional creds file, reconnects)."""

from __future__ import annotations

import base64
import logging
from pathlib import Path

import nats
import nkeys
from nats.aio.client import Client

from shared.settings import MeshSettings

log = logging.getLogger(__name__)


async def connect(
    settings: MeshSettings, name: str, *, persistent: bool = True,
    creds: Path | None = None, user: tuple[str, bytes] | None = None,
) -> Client:
    """Connect to ``settings.nats_url`` as client ``name``.

    A ``persistent`` client (a service) retries the first connection and reconnects
    forever; a command-line client gives up its first connection after a few attempts
    (about 3 s), so a missing server is reported instead of waited for, but once connected
    it too reconnects forever (:func:`keep_reconnecting`): a server restart or a cluster
    failover during `crawlmesh crawl --wait` must not end the wait. Uses ``settings.nats_creds`` (a user creds
    file) when set, else ``<home>/creds/mesh.creds`` when ``crawlmesh init`` wrote one, so
    operator mode is a setting. ``creds`` connects with another creds file (a tenant's);
    ``user`` with an in-memory ``(user JWT, nkey seed)`` that never touches the disk.

    Raises:
        nats.errors.NoServersError: no server reachable (non-persistent clients).
    """

    async def on_error(error: Exception) -> None:
        if persistent:
            log.warning("nats error: %s", error)

    async def on_disconnect() -> None:
        log.info("disconnected from nats")

    async def on_reconnect() -> None:
        log.info("reconnected to nats")

    auth: dict[str, object] = {}
    if user is not None:
        token, seed = user

        def user_jwt() -> bytearray:
            return bytearray(token.encode())

        def sign(nonce: str) -> bytes:
            return base64.b64encode(nkeys.from_seed(bytearray(seed)).sign(nonce.encode()))

        auth = {"user_jwt_cb": user_jwt, "signature_cb": sign}
    else:
        path = creds or settings.creds_path
        auth = {"user_credentials": str(path) if path else None}
    nc = await nats.connect(
        servers=[url.strip() for url in settings.nats_url.split(",")],
        name=name,
        **auth,  # type: ignore[arg-type]
        connect_timeout=settings.nats_connect_timeout_s,
        max_reconnect_attempts=-1 if persistent else 3,
        reconnect_time_wait=1.0,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    return keep_reconnecting(nc)


def keep_reconnecting(nc: Client) -> Client:
    """Make a connected client reconnect forever (1 s apart) from now on; returns it.

    nats-py reads ``max_reconnect_attempts`` from ``options`` at every attempt, so a client
    connected with few attempts (to fail fast when no server is there) can be told to ride
    out a later outage: with the limit, a CLI client closed itself about 1.5 s into a
    nats-server restart and `crawlmesh crawl --wait` never saw the completion event.
    """
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = 1.0
    return nc
