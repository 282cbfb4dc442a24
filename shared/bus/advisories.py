"""Dead-lettering messages whose handler never settled them (crash, ack timeout).

JetStream emits ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`` when a
message reaches ``max_deliver`` without an ack; the ``ADVISORIES`` stream captures these so
none is missed while no service runs. :class:`MaxDeliveriesHandler` (consumer
``dlq-advisor``, run by every service) reads the original message by stream sequence,
dead-letters it (id ``<stream>:<seq>``, so never twice) and deletes it from its work-queue
stream, where it would otherwise stay forever.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ConfigDict

from shared.bus.deadletter import DeadLetterPublisher
from shared.bus.loop import Delivery, Outbound
from shared.contracts.base import Contract
from shared.streams import DLQ, EXPANDED, FETCHED, LINKS, MESH_CONSUMERS, PARSED, ConsumerSpec
from shared.subjects import Stage

log = logging.getLogger(__name__)


class MaxDeliveriesAdvisory(Contract):
    """The fields crawlmesh reads from ``io.nats.jetstream.advisory.v1.max_deliver``."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    type: str
    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


def stage_of(stream: str, consumer: str, extra: Sequence[ConsumerSpec] = ()) -> Stage:
    """The stage owning ``consumer`` on ``stream`` (intake streams belong to the seeder).

    Unknown consumers are attributed to the sink, the stage that records failures.
    """
    for spec in (*MESH_CONSUMERS, *extra):
        if spec.durable == consumer and spec.stream == stream:
            return spec.stage
    by_stream = {LINKS.name: Stage.DEDUP, FETCHED.name: Stage.PARSER, PARSED.name: Stage.SINK,
                 EXPANDED.name: Stage.SINK}  # per-tenant consumers (tenant_stage_consumers)
    if stream in by_stream:
        return by_stream[stream]
    if stream.startswith("INTAKE_"):
        return Stage.SEEDER
    return Stage.SINK


class MaxDeliveriesHandler:
    """Handler for the ``dlq-advisor`` consumer (see module docstring)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.dead_letters = DeadLetterPublisher(js)

    async def handle(self, message: MaxDeliveriesAdvisory, delivery: Delivery) -> list[Outbound]:
        """Dead-letter the exhausted message, then delete it from its stream.

        Raises:
            TransientError: the dead letter could not be published (retried).
        """
        if message.stream == DLQ.name:
            # A dead letter that the sink could not record: keep it where it is (listing
            # and replay still see it) rather than dead-lettering a dead letter forever.
            log.error("dead letter %s seq %d exhausted its deliveries; left in %s",
                      message.stream, message.stream_seq, DLQ.name)
            return []
        try:
            original = await self.js.get_msg(message.stream, message.stream_seq)
        except NotFoundError:
            log.info("advisory for %s seq %d: message already gone", message.stream,
                     message.stream_seq)
            return []
        headers = {k: v for k, v in (original.headers or {}).items()}
        await self.dead_letters.publish(
            stage=stage_of(message.stream, message.consumer),
            stream=message.stream,
            subject=original.subject or "",
            stream_seq=message.stream_seq,
            payload=original.data or b"",
            headers=headers,
            reason=(
                f"max deliveries ({message.deliveries}) exhausted without an ack: the handler "
                "crashed or timed out"
            ),
            delivered=message.deliveries,
        )
        try:
            await self.js.delete_msg(message.stream, message.stream_seq)
        except NotFoundError:
            pass
        return []
