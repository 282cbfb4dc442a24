"""Sink service entry: wires JetStream, the page states and the job store."""

from __future__ import annotations

from nats.aio.client import Client
from nats.js import JetStreamContext

from services.sink.completion import CompletionTracker
from services.sink.handler import DeadLetterHandler, ExpansionHandler, PageLedger, ResultHandler
from services.sink.pages import KvPageStates
from shared.bus.outcomes import TransientError
from shared.bus.service import LoopSpec
from shared.codec import encode
from shared.contracts import DeadLetter, PageExpanded, ParsedPage
from shared.contracts.base import Contract
from shared.jobs import JobStore, ledger_counts
from shared.settings import MeshSettings
from shared.streams import SINK, SINK_DLQ, SINK_EXPANDED


class JetStreamPublisher:
    """Publishes with a ``Nats-Msg-Id`` and waits for the PubAck."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def publish(self, subject: str, message: Contract, msg_id: str) -> None:
        """Raises:
        TransientError: no PubAck (stream full, quota, timeout): the input is retried.
        """
        try:
            await self.js.publish(subject, encode(message), headers={"Nats-Msg-Id": msg_id})
        except Exception as error:
            raise TransientError(f"publish to {subject} failed: {error!r}") from error


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec]:
    js = nc.jetstream()
    publisher = JetStreamPublisher(js)
    jobs = JobStore(js)

    async def counts(tenant: str, job: str):  # type: ignore[no-untyped-def]
        return await ledger_counts(js, tenant, job)

    ledger = PageLedger(publisher, KvPageStates(js), CompletionTracker(publisher, jobs, counts))
    return [
        LoopSpec(SINK, ParsedPage, ResultHandler(ledger)),
        LoopSpec(SINK_EXPANDED, PageExpanded, ExpansionHandler(ledger)),
        LoopSpec(SINK_DLQ, DeadLetter, DeadLetterHandler(ledger)),
    ]
