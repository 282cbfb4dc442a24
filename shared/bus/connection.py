"""Connecting to NATS with the mesh settings (URL, optional creds file, reconnects)."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

from shared.settings import MeshSettings

log = logging.getLogger(__name__)


async def connect(settings: MeshSettings, name: str, *, persistent: bool = True) -> Client:
    """Connect to ``settings.nats_url`` as client ``name``.

    A ``persistent`` client (a service) retries the first connection and reconnects
    forever; a command-line client gives up after a few attempts (about 3 s), so a missing
    server is reported instead of waited for. Uses ``settings.nats_creds`` (a user creds
    file) when set, so operator mode is a setting.

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

    return await nats.connect(
        servers=[url.strip() for url in settings.nats_url.split(",")],
        name=name,
        user_credentials=str(settings.nats_creds) if settings.nats_creds else None,
        connect_timeout=settings.nats_connect_timeout_s,
        max_reconnect_attempts=-1 if persistent else 3,
        reconnect_time_wait=1.0,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
