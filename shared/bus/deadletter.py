"""Publishing dead letters: the original message, its headers, stage, tenant, job, reason.

A dead letter's ``Nats-Msg-Id`` is ``dlq:<stream>:<sequence>`` of the original, so the
in-loop path (last delivery failed) and the advisory path (process died on it) never
double it, however many replicas race.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from shared import subjects
from shared.bus.outcomes import TransientError
from shared.codec import encode
from shared.contracts.results import DeadLetter

ORIGINAL_HEADERS_KEPT = 32
"""At most this many original headers are kept in a dead letter."""


def dead_letter_id(stream: str, stream_seq: int) -> str:
    """``<stream>:<sequence>``: the id of a dead letter and the suffix of its msg id."""
    return f"{stream}:{stream_seq}"


class DeadLetterPublisher:
    """Publishes :class:`DeadLetter` messages on ``mesh.dlq.<stage>.<tenant>.<job>``."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js

    async def publish(
        self,
        *,
        stage: str,
        stream: str,
        subject: str,
        stream_seq: int,
        payload: bytes,
        headers: dict[str, str],
        reason: str,
        delivered: int,
    ) -> DeadLetter:
        """Publish a dead letter and wait for its PubAck.

        Raises:
            TransientError: the publish failed (the caller leaves the original unacked).
        """
        try:
            route = subjects.parse(subject)
            tenant, job = route.tenant, route.job
        except subjects.SubjectError:
            tenant, job = "unknown", subjects.NO_JOB
        letter_id = dead_letter_id(stream, stream_seq)
        kept = {k: v for k, v in list(headers.items())[:ORIGINAL_HEADERS_KEPT]}
        letter = DeadLetter(
            id=letter_id, tenant=tenant, job_id=job, stage=stage, reason=reason[:2000],
            delivery_count=delivered, subject=subject, stream=stream, stream_seq=stream_seq,
            headers=kept, original=payload,
        )
        try:
            await self.js.publish(
                subjects.dlq(stage, tenant, job), encode(letter),
                headers={"Nats-Msg-Id": f"dlq:{letter_id}"},
            )
        except Exception as error:
            raise TransientError(f"dead letter publish failed: {error!r}") from error
        return letter
