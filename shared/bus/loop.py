"""The consume loop every service runs: pull, validate, handle, publish, then ack.

For each delivery of a durable pull consumer (explicit ack):

1. decode the payload into the handler's input model (invalid -> dead letter at once);
2. call ``handler.handle(message, delivery)``; while it runs, send ``in_progress`` every
   third of the ack wait so long work is not redelivered;
3. publish every :class:`Outbound` with its deterministic ``Nats-Msg-Id`` and wait for
   each PubAck (a redelivered input therefore produces no duplicate output inside the
   stream's duplicate window);
4. only then ack. Failures become nak-with-delay or dead letter + term, decided by
   :func:`shared.bus.outcomes.decide`.

Each delivery is handled inside a CONSUMER span continuing the trace of its
``traceparent`` header, and each output carries the context of its own PRODUCER span
(:mod:`shared.telemetry.tracing`); log lines of a delivery carry its tenant, job and
trace ids (:mod:`shared.telemetry.logs`).

On stop (SIGTERM) the loop fetches nothing more, lets in-flight handlers finish for up to
``shutdown_grace_s`` and naks (without delay) what is still running, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, Protocol, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from shared import subjects
from shared.bus import replays
from shared.bus.deadletter import DeadLetterPublisher
from shared.bus.outcomes import TransientError, Verdict, decide
from shared.codec import decode, encode
from shared.contracts.base import Contract
from shared.settings import MeshSettings
from shared.streams import ConsumerSpec, consumer_backoff
from shared.telemetry import logs, metrics, tracing

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Contract)
M_contra = TypeVar("M_contra", bound=Contract, contravariant=True)


@dataclass(frozen=True, slots=True)
class Outbound:
    """A message a handler wants published: subject, message and ``Nats-Msg-Id``."""

    subject: str
    message: Contract
    msg_id: str
    headers: dict[str, str] = field(default_factory=dict)
    core: bool = False
    """Plain NATS publish (a reply to a requester), not JetStream: no PubAck, no msg id."""
    phase: int = 0
    """Outputs are published phase by phase: all of phase 0 acknowledged before phase 1."""
    new_trace: bool = False
    """Start a new trace with this output (a page admitted by dedup): its root span is
    linked to the current span instead of being its child."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a handler may know of the delivery, without NATS types."""

    subject: str
    headers: dict[str, str]
    delivered: int
    stream_seq: int
    tenant: str
    job: str
    published_at: datetime | None = None


class StageFull(TransientError):
    """A stage stream refused an output (PubAck error 10077): the tenant+job's subject holds
    its cap of ``max_msgs_per_subject`` messages (``discard_new_per_subject``), or the whole
    stream is full. Not a failure of the input: the loop waits for room (back-pressure)."""

    def __init__(self, subject: str, description: str) -> None:
        super().__init__(f"{subject}: {description}")
        self.subject = subject


STREAM_FULL = 10077
"""JetStream's ``JSStreamStoreFailedF``: "maximum messages per subject exceeded",
"maximum bytes exceeded", "maximum messages exceeded" (nats-server 2.15)."""

BUSY_FETCH_S = 1.0
"""Timeout of a batch pull while messages are flowing, seconds."""

IDLE_FETCH_MIN_S, IDLE_FETCH_MAX_S = 1.0, 5.0
"""After a pull that found nothing, the loop waits for one message with a lingering pull
of this long, doubling from the first to the second while the consumer stays idle,
seconds (a message is delivered the moment it arrives, so this costs no latency)."""

BACKPRESSURE_MAX_WAIT_S = 2.0
"""Longest pause between two attempts to publish into a full stage subject, seconds."""


class Handler(Protocol[M_contra]):
    """A service's pure handler: input model in, outbound messages out."""

    async def handle(self, message: M_contra, delivery: Delivery) -> Sequence[Outbound]: ...


async def publish_all(js: JetStreamContext, outputs: Sequence[Outbound]) -> None:
    """Publish ``outputs`` concurrently, each with its ``Nats-Msg-Id``; wait for every PubAck.

    Outputs of a lower ``phase`` are all acknowledged before any of a higher one is sent
    (dedup's frontier and ledger entries land before its expansion report). Each is sent
    inside its own PRODUCER span, whose W3C trace context goes in its headers.

    Raises:
        StageFull: a ``mesh.*`` stage stream refused an output for lack of room (its phase's
            other outputs were still sent; later phases were not).
        TransientError: a publish failed or timed out (the input will be retried; the
            outputs that did land are de-duplicated by their ids).
    """
    if not outputs:
        return

    async def one(out: Outbound) -> None:
        with tracing.publishing(out.subject, out.msg_id, out.message, out.new_trace) as context:
            if out.core:
                await js._nc.publish(out.subject, encode(out.message),
                                     headers={**out.headers, **context})
                return
            headers = {**out.headers, **context, "Nats-Msg-Id": out.msg_id}
            try:
                await js.publish(out.subject, encode(out.message), headers=headers)
            except APIError as error:
                if error.err_code == STREAM_FULL and out.subject.startswith("mesh."):
                    raise StageFull(out.subject, str(error.description)) from error
                raise

    for phase in sorted({out.phase for out in outputs}):
        batch = [out for out in outputs if out.phase == phase]
        results = await asyncio.gather(*(one(out) for out in batch), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if full := [e for e in errors if isinstance(e, StageFull)]:
            raise full[0]
        if errors:
            raise TransientError(f"publish failed: {errors[0]!r}", retry_after_s=None)


class ConsumeLoop(Generic[M]):
    """Runs ``handler`` over one durable consumer until ``stop`` is set."""

    def __init__(
        self,
        nc: Client,
        spec: ConsumerSpec,
        model: type[M],
        handler: Handler[M],
        settings: MeshSettings,
        stop: asyncio.Event,
        *,
        concurrency: int | None = None,
        decoder: Callable[[bytes], M] | None = None,
        pool: asyncio.Semaphore | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.spec = spec
        self.model = model
        self.handler = handler
        self.decoder: Callable[[bytes], M] = decoder or (lambda data: decode(data, model))
        self.settings = settings
        self.stop = stop
        self.concurrency = concurrency or settings.concurrency
        self.pool = pool
        """Handler slots shared with other loops (one per tenant): a delivery waits for a
        slot with its ``in_progress`` heartbeat running; asyncio wakes waiters in arrival
        order, so the loops of several tenants take turns."""
        self.dead_letters = DeadLetterPublisher(self.js)
        self.max_deliver = -1 if spec.unlimited_deliveries else settings.max_deliver
        self.backoff_s = consumer_backoff(spec, settings)
        """This consumer's redelivery delays, seconds (the first is its ack wait)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._fault: re.Pattern[bytes] | None = None
        if settings.fault_inject:
            stage, _, pattern = settings.fault_inject.partition(":")
            if stage == spec.stage and spec.durable not in ("dlq-advisor", "sink-dlq"):
                self._fault = re.compile(pattern.encode())

    async def run(self) -> None:
        """Pull and process until stopped; then drain in-flight work (see module doc)."""
        sub = await self.js.pull_subscribe_bind(self.spec.durable, self.spec.stream)
        idle_s = 0.0  # > 0: the last fetch found nothing; wait this long for one message
        try:
            while not self.stop.is_set():
                free = self.concurrency - len(self._tasks)
                if free <= 0:  # every slot busy: wait for one, or for stop (then drain)
                    stopping = asyncio.ensure_future(self.stop.wait())
                    await asyncio.wait({*self._tasks, stopping},
                                       return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    continue
                try:
                    if idle_s:
                        msgs = await self._wait_for_work(sub, idle_s)
                        if msgs is None:  # stopped while waiting
                            break
                    else:
                        msgs = await sub.fetch(min(free, self.settings.fetch_batch),
                                               timeout=BUSY_FETCH_S)
                    idle_s = 0.0
                except (NatsTimeoutError, TimeoutError):
                    idle_s = min(max(idle_s * 2, IDLE_FETCH_MIN_S), IDLE_FETCH_MAX_S)
                    continue
                except Exception as error:  # connection trouble: back off, keep going
                    log.warning("fetch from %s/%s failed: %r",
                                self.spec.stream, self.spec.durable, error)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), 1.0)
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self._process(msg))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            await self._drain()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _wait_for_work(self, sub: JetStreamContext.PullSubscription,
                             wait_s: float) -> list[Msg] | None:
        """Wait up to ``wait_s`` seconds for one message (a lingering pull of one, answered
        the moment a message arrives), or until stop (then None).

        An idle consumer thus costs one pull request per ``wait_s`` rather than two per
        second. A pull cancelled by stop may still deliver one message after the loop
        unsubscribed: it is redelivered after the ack wait, like any unacked message.
        """
        fetching = asyncio.ensure_future(sub.fetch(1, timeout=wait_s))
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({fetching, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if not fetching.done():
            fetching.cancel()
            with contextlib.suppress(BaseException):
                await fetching
            return None
        return fetching.result()

    async def _drain(self) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.shutdown_grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    async def _process(self, msg: Msg) -> None:
        meta = msg.metadata
        delivered = meta.num_delivered or 1
        headers = dict(msg.headers or {})
        try:
            route = subjects.parse(msg.subject)
            tenant, job = route.tenant, route.job
        except subjects.SubjectError:
            tenant, job = "unknown", subjects.NO_JOB
        delivery = Delivery(
            subject=msg.subject, headers=headers, delivered=delivered,
            stream_seq=meta.sequence.stream, tenant=tenant, job=job,
            published_at=meta.timestamp,
        )
        replays.handling(replays.of(headers))  # this task only: a replay in flight
        started = time.perf_counter()
        with logs.delivery_context(tenant, job), tracing.consuming(
            msg.subject, headers, consumer=self.spec.durable, tenant=tenant, job=job,
            delivered=delivered, stream_seq=delivery.stream_seq,
        ) as span:
            heartbeat = asyncio.create_task(self._heartbeat(msg))
            error: BaseException | None = None
            try:
                message = self.decoder(msg.data)
                if self._fault is not None and self._fault.search(msg.data):
                    raise RuntimeError(
                        f"injected fault (CRAWLMESH_FAULT_INJECT) in {self.spec.stage}")
                if self.pool is None:
                    outputs = await self.handler.handle(message, delivery)
                else:
                    async with self.pool:
                        outputs = await self.handler.handle(message, delivery)
                await self._publish(outputs, delivery)
            except asyncio.CancelledError:
                heartbeat.cancel()
                tracing.settled(span, "nak", "cancelled (stopping)")
                with contextlib.suppress(Exception):
                    await msg.nak()
                raise
            except Exception as caught:
                error = caught
            finally:
                heartbeat.cancel()
            await self._settle(msg, delivery, error)
        metrics.HANDLER_DURATION.labels(str(self.spec.stage), self.spec.durable).observe(
            time.perf_counter() - started)

    async def _publish(self, outputs: Sequence[Outbound], delivery: Delivery) -> None:
        """:func:`publish_all`, waiting while a stage subject is full (back-pressure).

        The input stays unacked with its ``in_progress`` heartbeat running, outside the
        shared handler slots, so it does not count as a delivery and a tenant that fills
        its cap slows only its own loop; other tenants' subjects have room of their own.
        Retried with exponential backoff (50 ms doubling to
        :data:`BACKPRESSURE_MAX_WAIT_S`) until the stage's consumer makes room; on stop the
        drain cancels the wait and the input is nak'ed for redelivery.

        The outputs of a page replay (``crawlmesh dlq replay``) carry its replay headers and
        ``:replay<N>`` msg ids (:func:`shared.bus.replays.carry`).
        """
        outputs = replays.carry(outputs, replays.of(delivery.headers))
        pause = 0.05
        waited = 0.0
        while True:
            try:
                await publish_all(self.js, outputs)
                break
            except StageFull as full:
                if waited == 0.0:
                    log.info("stage full, holding %s until there is room: %s",
                             delivery.subject, full)
                metrics.BACKPRESSURE_WAITS.labels(
                    str(self.spec.stage), delivery.tenant, full.subject.split(".")[1]).inc()
                await asyncio.sleep(pause)
                waited += pause
                pause = min(pause * 2, BACKPRESSURE_MAX_WAIT_S)
        if waited:
            metrics.BACKPRESSURE_SECONDS.labels(str(self.spec.stage), delivery.tenant).inc(waited)

    async def _settle(self, msg: Msg, delivery: Delivery, error: BaseException | None) -> None:
        outcome = decide(error, delivery.delivered, self.max_deliver, self.backoff_s)
        tracing.settled(tracing.current_span(), str(outcome.verdict), outcome.reason, error)
        stage, consumer = str(self.spec.stage), self.spec.durable
        metrics.MESSAGES.labels(stage, consumer, delivery.tenant, outcome.verdict).inc()
        if outcome.verdict is Verdict.DEAD_LETTER:
            metrics.DEAD_LETTERS.labels(stage, delivery.tenant).inc()
        try:
            if outcome.verdict is Verdict.ACK:
                await msg.ack()
            elif outcome.verdict is Verdict.NAK:
                log.info("nak %s (delivery %d, retry in %.1fs): %s", delivery.subject,
                         delivery.delivered, outcome.delay_s, outcome.reason)
                await msg.nak(delay=self._nak_delay(outcome.delay_s, delivery.delivered))
            else:
                log.warning("dead-lettering %s seq %d: %s", delivery.subject,
                            delivery.stream_seq, outcome.reason)
                await self.dead_letters.publish(
                    stage=self.spec.stage, stream=self.spec.stream, subject=msg.subject,
                    stream_seq=delivery.stream_seq, payload=msg.data,
                    headers=delivery.headers, reason=outcome.reason,
                    delivered=delivery.delivered,
                )
                await msg.term()
        except (APIError, NatsTimeoutError, TimeoutError, TransientError) as failure:
            # The dead letter (or the ack) did not land: leave the message unacked. It is
            # redelivered, or, past max_deliver, caught by the MAX_DELIVERIES advisory.
            log.error("could not settle %s seq %d: %r", delivery.subject,
                      delivery.stream_seq, failure)

    def _nak_delay(self, delay_s: float, delivered: int) -> float:
        """The delay to send with ``-NAK`` so redelivery comes ``delay_s`` seconds from now.

        On a consumer with a backoff schedule, nats-server (2.15: ``processNak`` and
        ``checkPending`` in ``server/consumer.go``) backdates a delayed nak by the ack wait
        (``backoff[0]``) but then waits for ``backoff[n - 1]`` of delivery ``n``: the
        redelivery comes ``delay + backoff[n - 1] - backoff[0]`` after the nak. Subtract that
        excess; a delay shorter than the excess cannot be had (a delayed nak is redelivered
        no sooner), so never send less than 1 ms (a zero delay would be an immediate nak).
        """
        backoff = self.backoff_s
        if self.spec.unlimited_deliveries or not backoff:  # that consumer has no backoff
            return delay_s
        excess = backoff[min(max(delivered, 1), len(backoff)) - 1] - backoff[0]
        return max(delay_s - excess, 0.001)

    async def _heartbeat(self, msg: Msg) -> None:
        """Send ``in_progress`` every third of the ack wait until cancelled; a failed send
        (e.g. while reconnecting) is retried at the next beat, never ends the heartbeat."""
        interval = max(min(self.settings.ack_wait_s, self.backoff_s[0]) / 3, 0.2)
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(interval)
                try:
                    await msg.in_progress()
                except Exception as error:
                    log.debug("in_progress for %s failed: %r", msg.subject, error)
