"""Sink service entry: wires JetStream, the page states, the job store and the results
writer; one parked-results loop per tenant (following the registry, no restart).

The sink also publishes the JetStream gauges (:mod:`shared.telemetry.jetstream`) and lifts
stale pauses (:func:`lift_stale_pauses`), run beside its loops (:data:`BESIDE`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext

from services.sink.completion import CompletionTracker
from services.sink.handler import (
    DeadLetterHandler,
    ExpansionHandler,
    PageLedger,
    ParkedHandler,
    ResultHandler,
)
from services.sink.pages import KvPageStates
from services.sink.results import QUOTA_ERR_CODES, ResultsWriter, is_quota_error
from shared import subjects
from shared.bus.outcomes import TransientError
from shared.bus.service import Beside, LoopSpec, TenantLoops
from shared.codec import encode
from shared.contracts import DeadLetter, PageExpanded, PageResult, ParsedPage
from shared.contracts.base import Contract
from shared.jobs import JobStore, ledger_counts
from shared.settings import MeshSettings
from shared.streams import (
    SINK_DLQ,
    parked_consumer,
    sink_consumer,
    sink_expanded_consumer,
)
from shared.telemetry import metrics
from shared.telemetry.jetstream import publish_jetstream_gauges
from shared.tenantgate import TenantGate

log = logging.getLogger(__name__)

PAUSE_CHECK_S = 2.0
"""How often :func:`lift_stale_pauses` looks for pauses with no parked result left."""


async def lift_stale_pauses(nc: Client, settings: MeshSettings, stop: asyncio.Event) -> None:
    """Lift every pause whose tenant has no parked result (e.g. its last parked result was
    drained just before the pause was written, or its job was cancelled)."""
    writer = ResultsWriter(nc, TenantGate(nc.jetstream()), settings)
    while not stop.is_set():
        try:
            for tenant in await writer.gate.paused_tenants():
                await writer.clear_if_drained(tenant)
        except Exception as error:  # next round
            log.warning("checking tenant pauses failed: %r", error)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), PAUSE_CHECK_S)


BESIDE: tuple[Beside, ...] = (publish_jetstream_gauges, lift_stale_pauses)
"""Run beside the sink's loops: the JetStream gauges, and lifting stale pauses."""

__all__ = ["BESIDE", "QUOTA_ERR_CODES", "JetStreamPublisher", "is_quota_error", "setup"]

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


async def setup(nc: Client, settings: MeshSettings) -> list[LoopSpec | TenantLoops]:
    js = nc.jetstream()
    publisher = JetStreamPublisher(js)
    jobs = JobStore(js)
    results = ResultsWriter(nc, TenantGate(js), settings)

    async def counts(tenant: str, job: str):  # type: ignore[no-untyped-def]
        return await ledger_counts(js, tenant, job)

    ledger = PageLedger(publisher, KvPageStates(js), CompletionTracker(publisher, jobs, counts),
                        results)
    parked = ParkedHandler(ledger, results)

    def parked_loop(tenant_id: str) -> LoopSpec:
        return LoopSpec(parked_consumer(tenant_id), PageResult, parked, concurrency=1)

    result_handler, expansion_handler = ResultHandler(ledger), ExpansionHandler(ledger)

    def results_loop(tenant_id: str) -> LoopSpec:
        return LoopSpec(sink_consumer(tenant_id), ParsedPage, result_handler)

    def expanded_loop(tenant_id: str) -> LoopSpec:
        return LoopSpec(sink_expanded_consumer(tenant_id), PageExpanded, expansion_handler)

    # Per tenant (tenants take turns for the shared slots: round-robin draining).
    return [
        TenantLoops("sink", results_loop, shared_slots=settings.concurrency),
        TenantLoops("sink-expanded", expanded_loop, shared_slots=settings.concurrency),
        LoopSpec(SINK_DLQ, DeadLetter, DeadLetterHandler(ledger)),
        TenantLoops("sink-parked", parked_loop),
    ]
