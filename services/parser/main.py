"""Parser service entry."""

from __future__ import annotations

from nats.aio.client import Client

from services.parser.handler import ParserHandler
from shared.bus.service import LoopSpec
from shared.contracts import FetchedPage
from shared.settings import MeshSettings
from shared.streams import PARSER


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    return [LoopSpec(PARSER, FetchedPage, ParserHandler())]
