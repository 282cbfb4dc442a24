"""Sink service entry."""

from __future__ import annotations

from nats.aio.client import Client

from services.sink.handler import DeadLetterHandler, ExpansionHandler, SinkHandler
from shared.bus.service import LoopSpec
from shared.contracts import DeadLetter, PageExpanded, ParsedPage
from shared.settings import MeshSettings
from shared.streams import SINK, SINK_DLQ, SINK_EXPANDED


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    return [
        LoopSpec(SINK, ParsedPage, SinkHandler()),
        LoopSpec(SINK_EXPANDED, PageExpanded, ExpansionHandler()),
        LoopSpec(SINK_DLQ, DeadLetter, DeadLetterHandler()),
    ]
