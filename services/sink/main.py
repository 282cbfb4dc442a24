"""Sink service entry: wires JetStream, the page states and the job store.

The sink also publishes the JetStream gauges (:mod:`shared.telemetry.jetstream`), run
beside its loops (:data:`BESIDE`).
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError

from services.sink.completion import CompletionTracker
from services.sink.handler import DeadLetterHandler, ExpansionHandler, PageLedger, ResultHandler
from services.sink.pages import KvPageStates
from shared import subjects
from shared.bus.outcomes import TransientError
from shared.bus.service import Beside, LoopSpec
from shared.codec import encode
from shared.contracts import DeadLetter, PageExpanded, ParsedPage
from shared.contracts.base import Contract
from shared.jobs import JobStore, ledger_counts
from shared.settings import MeshSettings
from shared.streams import SINK, SINK_DLQ, SINK_EXPANDED
from shared.telemetry import metrics
from shared.telemetry.jetstream import publish_jetstream_gauges

BESIDE: tuple[Beside, ...] = (publish_jetstream_gauges,)
"""Run beside the sink's loops: the consumer-backlog and tenant-storage gauges."""

QUOTA_ERR_CODES = frozenset({
    10002,  # JSAccountResourcesExceededErr: the account's JetStream limits are reached
    10023,  # JSInsufficientResourcesErr
    10028,  # JSMemoryResourcesExceededErr
    10047,  # JSStorageResourcesExceededErr: the server's store reservation is used up
    10077,  # JSStreamStoreFailedF: "maximum bytes/messages exceeded" (stream limits)
})
"""JetStream ``err_code``s (nats-server ``server/errors.json``) that mean a publish was
refused because a stream, account or server is full."""


def is_quota_error(error: BaseException) -> bool:
    """True if ``error`` is JetStream refusing a publish for lack of room (see above)."""
    return isinstance(error, APIError) and error.err_code in QUOTA_ERR_CODES


class JetStreamPublisher:
    """Publishes with a ``Nats-Msg-Id`` and waits for the PubAck."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def publish(self, subject: str, message: Contract, msg_id: str) -> bool:
        """Publish; True if stored, False if the server already had ``msg_id`` (duplicate).

        A refusal for lack of room in a tenant's stream (``tenant.<id>.…``) counts in
        ``crawlmesh_quota_errors_total``.

        Raises:
            TransientError: no PubAck (stream full, quota, timeout): the input is retried.
        """
        try:
            ack = await self.js.publish(subject, encode(message), headers={"Nats-Msg-Id": msg_id})
        except Exception as error:
            if is_quota_error(error) and subject.startswith("tenant."):
                metrics.QUOTA_ERRORS.labels(subjects.parse(subject).tenant).inc()
            raise TransientError(f"publish to {subject} failed: {error!r}") from error
        return not ack.duplicate


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
