"""Results into a tenant's RESULTS stream, or parked when the tenant has no room.

Before writing, the sink checks the tenant's RESULTS configuration through the service
import ``tenant.<id>.api.results`` (``$JS.API.STREAM.INFO.RESULTS`` of the tenant): it
must be as :func:`shared.streams.tenant_stream_config` made it on the points
:func:`shared.streams.tenant_stream_problem` checks (a tenant cannot change it, but a
control-plane bug could). A good answer is trusted for ``check_ttl_s`` seconds.

A result is *parked* — published on ``mesh.parked.<tenant>.<job>`` (MESH's ``PARKED``
stream, ``Nats-Msg-Id`` per page) so the input can be acked, never retried until it
dead-letters — when the publish is refused for lack of room (:data:`QUOTA_ERR_CODES`),
nothing answers (RESULTS deleted), or the configuration is unsafe. Parking pauses the
tenant's admission (:class:`shared.tenantgate.TenantGate`) and tells each job once per
pause, by a ``progress`` event whose reason reads e.g. "storage quota exceeded: N of M
bytes used" (N: RESULTS bytes, M: the tenant's storage quota). The sink's per-tenant
parked loop retries the head parked result; once the backlog is empty the pause is lifted.
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum

import orjson
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.js.api import StreamConfig
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from shared import subjects
from shared.accounts import claims
from shared.bus.outcomes import TransientError
from shared.codec import encode
from shared.contracts import JobEvent, JobEventKind, PageResult
from shared.settings import MeshSettings
from shared.streams import PARKED, RESULTS, parked_consumer, tenant_stream_config, tenant_stream_problem
from shared.subjects import Stage
from shared.telemetry import metrics
from shared.tenantgate import TenantGate

log = logging.getLogger(__name__)

QUOTA_ERR_CODES = frozenset({
    10002,  # JSAccountResourcesExceededErr: the account's JetStream limits are reached
    10023,  # JSInsufficientResourcesErr
    10028,  # JSMemoryResourcesExceededErr
    10047,  # JSStorageResourcesExceededErr: the server's store reservation is used up
    10077,  # JSStreamStoreFailedF: "maximum bytes/messages exceeded" (stream limits)
})
"""JetStream ``err_code``s (nats-server ``server/errors.json``) that mean a publish was
refused because a stream, account or server is full."""

STREAM_NOT_FOUND = 10059
PARKED_RETRY_S = 2.0
"""Delay between two tries of a tenant's head parked result, seconds."""


def is_quota_error(error: BaseException) -> bool:
    """True if ``error`` is JetStream refusing a publish for lack of room (see above)."""
    return isinstance(error, APIError) and error.err_code in QUOTA_ERR_CODES


class Delivered(StrEnum):
    STORED = "stored"
    DUPLICATE = "duplicate"
    PARKED = "parked"


class TenantFullError(TransientError):
    """The tenant still has no room (or no usable RESULTS): try the parked result later."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, retry_after_s=PARKED_RETRY_S)


class ResultsWriter:
    """Writes results for the sink (see module docstring)."""

    def __init__(self, nc: Client, gate: TenantGate, settings: MeshSettings,
                 check_ttl_s: float = 30.0) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.gate = gate
        self.settings = settings
        self.check_ttl_s = check_ttl_s
        self._checked: dict[str, float] = {}

    async def write(self, tenant: str, job: str, fingerprint: str, result: PageResult, *,
                    park: bool = True) -> Delivered:
        """Store ``result`` in the tenant's RESULTS; park it if the tenant has no room.

        Raises:
            TenantFullError: no room and ``park`` is False (the parked loop's retry).
            TransientError: no answer from JetStream (the input is retried).
        """
        problem = await self.problem(tenant)
        if problem is None:
            try:
                ack = await self.js.publish(
                    subjects.results(tenant, job), encode(result),
                    headers={"Nats-Msg-Id": subjects.msg_id(Stage.SINK, tenant, job,
                                                            fingerprint)})
            except (NoStreamResponseError, NoRespondersError):
                self._checked.pop(tenant, None)
                problem = await self.problem(tenant) or "the RESULTS stream does not answer"
            except APIError as error:
                if not is_quota_error(error):
                    raise TransientError(f"publish of a result failed: {error!r}") from error
                metrics.QUOTA_ERRORS.labels(tenant).inc()
                problem = await self.quota_problem(tenant)
            except Exception as error:
                raise TransientError(f"publish of a result failed: {error!r}") from error
            else:
                return Delivered.DUPLICATE if ack.duplicate else Delivered.STORED
        if not park:
            raise TenantFullError(problem)
        await self.park(tenant, job, fingerprint, result, problem)
        return Delivered.PARKED

    async def _stream_info(self, tenant: str) -> dict[str, object]:
        """The tenant's RESULTS stream info as JetStream answers it (JSON object)."""
        reply = await self.nc.request(claims.stream_info_subject(tenant, RESULTS), b"",
                                      timeout=5.0)
        value = orjson.loads(reply.data)
        return value if isinstance(value, dict) else {}

    async def problem(self, tenant: str) -> str | None:
        """Why the tenant's RESULTS cannot take results now, or None (good answers are
        trusted for ``check_ttl_s`` seconds; problems are checked again every time)."""
        checked = self._checked.get(tenant)
        if checked is not None and time.monotonic() - checked < self.check_ttl_s:
            return None
        try:
            info = await self._stream_info(tenant)
        except NoRespondersError:
            return "the RESULTS stream is unreachable (no responders)"
        except Exception as error:
            raise TransientError(f"RESULTS stream info failed: {error!r}") from error
        error = info.get("error")
        if isinstance(error, dict):
            if error.get("err_code") == STREAM_NOT_FOUND:
                return ("the RESULTS stream is missing: results are held until it exists "
                        "again (`crawlmesh tenant update` recreates it)")
            return f"the RESULTS stream cannot be read: {error.get('description')}"
        record = await self.gate.record(tenant)
        if record is None:
            return "unknown tenant"
        config = StreamConfig.from_response(dict(info.get("config") or {}))  # type: ignore[arg-type]
        expected = tenant_stream_config(RESULTS, self.settings, record.quota.storage_bytes)
        if (unsafe := tenant_stream_problem(config, expected)) is not None:
            return f"the RESULTS stream is misconfigured ({unsafe}): results are held"
        self._checked[tenant] = time.monotonic()
        return None

    async def quota_problem(self, tenant: str) -> str:
        """"storage quota exceeded: N of M bytes used" (N: RESULTS bytes, M: the quota)."""
        used = "?"
        try:
            state = (await self._stream_info(tenant)).get("state")
            if isinstance(state, dict):
                used = str(state.get("bytes", "?"))
        except Exception as error:  # the figure is informative only
            log.info("no RESULTS usage for tenant %s: %r", tenant, error)
        record = await self.gate.record(tenant)
        limit = record.quota.storage_bytes if record is not None else "?"
        return f"storage quota exceeded: {used} of {limit} bytes used"

    async def park(self, tenant: str, job: str, fingerprint: str, result: PageResult,
                   reason: str) -> None:
        """Park ``result``, pause the tenant and tell the job (once per pause)."""
        await self.js.publish(
            subjects.parked(tenant, job), encode(result),
            headers={"Nats-Msg-Id": subjects.msg_id(Stage.SINK, tenant, job,
                                                    f"parked-{fingerprint}")})
        log.info("parked a result of tenant %s job %s: %s", tenant, job, reason)
        pause, tell = await self.gate.set_pause(tenant, job, reason)
        if not tell:
            return
        try:
            await self.js.publish(
                subjects.events(tenant, job),
                encode(JobEvent(tenant=tenant, job_id=job, kind=JobEventKind.PROGRESS,
                                reason=f"{reason}; admission paused, results held")),
                headers={"Nats-Msg-Id": subjects.msg_id(Stage.SINK, tenant, job,
                                                        f"paused-{pause.since_ms}")})
        except Exception as error:  # EVENTS full or gone too: the next parked result retries
            log.warning("could not tell tenant %s job %s of its pause: %r", tenant, job, error)
            return
        await self.gate.told(tenant, job)

    async def clear_if_drained(self, tenant: str, in_flight: int = 0) -> bool:
        """Lift the tenant's pause if its parked backlog is empty (``in_flight``: parked
        messages the caller is still handling). True if lifted."""
        pause = await self.gate.pause(tenant, fresh=True)
        if pause is None:
            return False
        try:
            info = await self.js.consumer_info(PARKED.name, parked_consumer(tenant).durable)
        except NotFoundError:
            pending = 0
        else:
            pending = (info.num_pending or 0) + max((info.num_ack_pending or 0) - in_flight, 0)
        if pending:
            return False
        if await self.gate.clear(tenant, pause):
            log.info("tenant %s has no parked results left: admission resumes", tenant)
            return True
        return False
