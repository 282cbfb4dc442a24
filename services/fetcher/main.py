"""Fetcher service entry."""

from __future__ import annotations

import httpx
from nats.aio.client import Client

from services.fetcher.handler import FetcherHandler
from shared.bus.service import LoopSpec
from shared.contracts import FrontierEntry
from shared.settings import MeshSettings
from shared.streams import FETCHER


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(10.0, connect=5.0), follow_redirects=True, max_redirects=5,
        headers={"User-Agent": "crawlmesh/0.1"},
    )
    return [LoopSpec(FETCHER, FrontierEntry, FetcherHandler(client))]
