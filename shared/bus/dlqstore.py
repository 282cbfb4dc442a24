"""Reading the dead letters stored in the ``DLQ`` stream, selected by stage, tenant, job, id.

The ``DLQ`` stream keeps every dead letter (limits retention) on
``mesh.dlq.<stage>.<tenant>.<job>``; the sink's consumer ``sink-dlq`` records each (a
``failed`` result for its page). :func:`read_letters` reads a selection with an ephemeral
consumer; :func:`recorded_up_to` says which the sink has recorded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from shared import subjects
from shared.codec import DecodeError, decode
from shared.contracts import DeadLetter
from shared.streams import DLQ, SINK_DLQ, StreamMissingError

NO_JOB_SHOWN = "-"
"""How the job of a seed submission (``subjects.NO_JOB``) is shown and filtered."""

FETCH_BATCH = 256
"""Dead letters read per pull."""


@dataclass(frozen=True, slots=True)
class StoredLetter:
    """A dead letter and where it is stored: its ``DLQ`` sequence and whether the sink has
    recorded it (``recorded``: see :func:`recorded_up_to`)."""

    dlq_seq: int
    letter: DeadLetter
    recorded: bool = True


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters a command acts on; None or empty: any."""

    stage: str | None = None
    tenant: str | None = None
    job: str | None = None
    ids: frozenset[str] = field(default_factory=frozenset)

    def subject(self) -> str:
        """The ``DLQ`` filter subject, e.g. ``mesh.dlq.parser.*.*``."""
        return f"mesh.dlq.{self.stage or '*'}.{self.tenant or '*'}.{self.job or '*'}"

    def matches(self, letter: DeadLetter) -> bool:
        return not self.ids or letter.id in self.ids


def job_token(job: str | None) -> str | None:
    """The job token of ``--job`` (``-``: seed submissions)."""
    if job is None:
        return None
    return subjects.NO_JOB if job == NO_JOB_SHOWN else subjects.check_token(job, "job id")


async def recorded_up_to(js: JetStreamContext) -> int | None:
    """The ``DLQ`` sequence up to which the sink has recorded (or given up on) every dead
    letter; None: no sink consumer, so nothing waits for it.

    The ack floor of ``sink-dlq``, or, while that consumer has nothing in flight, the last
    sequence it was delivered: nats-server (2.15) leaves the ack floor behind a message
    that exhausted its deliveries, so the floor alone could hold every later one back.
    """
    try:
        info = await js.consumer_info(DLQ.name, SINK_DLQ.durable)
    except NotFoundError:
        return None
    floor = info.ack_floor.stream_seq if info.ack_floor else 0
    if not info.num_ack_pending and info.delivered is not None:
        floor = max(floor, info.delivered.stream_seq)
    return floor


async def read_letters(js: JetStreamContext, selection: Selection) -> list[StoredLetter]:
    """Every dead letter ``selection`` matches, oldest first (an ephemeral consumer on the
    filter subject, read to its end). Messages that are not dead letters are skipped."""
    try:
        if (await js.stream_info(DLQ.name)).state.messages == 0:
            return []
    except NotFoundError:
        raise StreamMissingError("no DLQ stream: run `crawlmesh init`") from None
    floor = await recorded_up_to(js)
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                            inactive_threshold=30.0, mem_storage=True)
    sub = await js.pull_subscribe(selection.subject(), stream=DLQ.name, config=config)
    out: list[StoredLetter] = []
    try:
        left = (await sub.consumer_info()).num_pending or 0
        while left > 0:
            msgs = await sub.fetch(min(left, FETCH_BATCH), timeout=5.0)
            left -= len(msgs)
            for msg in msgs:
                try:
                    letter = decode(msg.data, DeadLetter)
                except DecodeError:
                    continue
                seq = msg.metadata.sequence.stream
                if selection.matches(letter):
                    out.append(StoredLetter(seq, letter, floor is None or seq <= floor))
    finally:
        await sub.unsubscribe()
        if config.name:
            with contextlib.suppress(Exception):
                await js.delete_consumer(DLQ.name, config.name)
    return out
