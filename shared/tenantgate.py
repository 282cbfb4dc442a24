"""Whether a tenant's work may advance: suspended tenants and tenants over quota are held.

Two sources, both in the MESH account's ``tenants`` KV bucket:

* ``tenant.<id>``: the :class:`~shared.tenancy.TenantRecord` (status ``suspended`` holds
  the tenant; the quota is read here by the seeder and the sink);
* ``paused.<id>``: a :class:`TenantPause` the sink writes when it parks a result (the
  tenant's RESULTS is full, missing or misconfigured) and deletes once the tenant's parked
  backlog is empty.

Dedup and the fetcher ask :meth:`TenantGate.hold_reason` (answers at most ``ttl_s`` old)
before admitting or fetching, and hold a held tenant's messages for a few seconds
(:meth:`TenantGate.wait_released`) before re-publishing them under a new message id — never
a ``nak``, which would count towards ``max_deliver``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from shared.bus.kvkeys import live_entries
from shared.streams import TENANTS_BUCKET
from shared.tenancy import TenantRecord, TenantStatus

PAUSE_PREFIX = "paused."
HOLD_S = 0.25
"""How long dedup and the fetcher hold a held tenant's message before re-publishing it
(seconds). Short on purpose: a held message goes back to the end of its stream, so other
tenants' messages behind it are not blocked; the hold only bounds how fast a stream holding
nothing but held messages cycles (64 hold slots / 0.25 s)."""


@dataclass(frozen=True, slots=True)
class TenantPause:
    """A tenant's admission pause: why, since when (ms since the epoch), the jobs told."""

    reason: str
    since_ms: int
    jobs: tuple[str, ...] = ()
    revision: int = 0

    def encode(self) -> bytes:
        return orjson.dumps({"reason": self.reason, "since_ms": self.since_ms,
                             "jobs": list(self.jobs)})

    @classmethod
    def decode(cls, data: bytes, revision: int) -> TenantPause:
        value = orjson.loads(data)
        return cls(str(value["reason"]), int(value["since_ms"]),
                   tuple(value.get("jobs", ())), revision)


class TenantGate:
    """Reads tenant records and pauses (cached ``ttl_s`` seconds) and writes pauses."""

    def __init__(self, js: JetStreamContext, ttl_s: float = 2.0) -> None:
        self.js = js
        self.ttl_s = ttl_s
        self._records: dict[str, tuple[float, TenantRecord | None]] = {}
        self._pauses: dict[str, tuple[float, TenantPause | None]] = {}

    async def _kv(self):  # type: ignore[no-untyped-def]
        return await self.js.key_value(TENANTS_BUCKET)

    async def record(self, tenant: str, fresh: bool = False) -> TenantRecord | None:
        """The tenant's registry record (None if unknown), at most ``ttl_s`` old unless
        ``fresh``."""
        hit = self._records.get(tenant)
        if hit and not fresh and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        kv = await self._kv()
        try:
            entry = await kv.get(f"tenant.{tenant}")
            record: TenantRecord | None = TenantRecord.model_validate_json(entry.value or b"")
        except KeyNotFoundError:
            record = None
        self._records[tenant] = (time.monotonic(), record)
        return record

    async def pause(self, tenant: str, fresh: bool = False) -> TenantPause | None:
        """The tenant's admission pause, or None."""
        hit = self._pauses.get(tenant)
        if hit and not fresh and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        kv = await self._kv()
        try:
            entry = await kv.get(PAUSE_PREFIX + tenant)
            found: TenantPause | None = TenantPause.decode(entry.value or b"{}",
                                                           entry.revision or 0)
        except KeyNotFoundError:
            found = None
        self._pauses[tenant] = (time.monotonic(), found)
        return found

    async def hold_reason(self, tenant: str) -> str | None:
        """Why the tenant's pages must not advance now (suspended, paused), else None."""
        record = await self.record(tenant)
        if record is not None and record.status is TenantStatus.SUSPENDED:
            return f"tenant {record.name} is suspended"
        pause = await self.pause(tenant)
        if pause is not None:
            return f"admission paused: {pause.reason}"
        return None

    async def wait_released(self, tenant: str, hold_s: float = HOLD_S) -> str | None:
        """Wait up to ``hold_s`` seconds for the tenant to be released; the reason it is
        still held afterwards, or None as soon as it is released."""
        deadline = time.monotonic() + hold_s
        while (reason := await self.hold_reason(tenant)) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return reason
            await asyncio.sleep(min(left, self.ttl_s / 2 or 0.5))
        return None

    async def paused_tenants(self) -> list[str]:
        """Ids of every tenant with a pause key (read fresh)."""
        values = await live_entries(self.js, await self._kv(), TENANTS_BUCKET,
                                    PAUSE_PREFIX + "*")
        return sorted(key[len(PAUSE_PREFIX):] for key in values)

    async def set_pause(self, tenant: str, job: str, reason: str) -> tuple[TenantPause, bool]:
        """Pause the tenant (or keep its pause) and note ``job``; the pause, and True if
        ``job`` must still be told (its event is published before :meth:`told`)."""
        kv = await self._kv()
        for _ in range(20):
            current = await self.pause(tenant, fresh=True)
            if current is None:
                new = TenantPause(reason, int(time.time() * 1000))
                try:
                    revision = await kv.create(PAUSE_PREFIX + tenant, new.encode())
                except KeyWrongLastSequenceError:
                    continue
                new = TenantPause(new.reason, new.since_ms, (), revision)
                self._pauses[tenant] = (time.monotonic(), new)
                return new, True
            if current.reason != reason:
                changed = TenantPause(reason, current.since_ms, current.jobs)
                try:
                    await kv.update(PAUSE_PREFIX + tenant, changed.encode(),
                                    last=current.revision)
                except KeyWrongLastSequenceError:
                    continue
                continue
            return current, job not in current.jobs
        raise RuntimeError(f"pause of tenant {tenant} kept changing")

    async def told(self, tenant: str, job: str) -> None:
        """Record that ``job`` got the event of the tenant's current pause."""
        kv = await self._kv()
        for _ in range(20):
            current = await self.pause(tenant, fresh=True)
            if current is None or job in current.jobs:
                return
            changed = TenantPause(current.reason, current.since_ms, (*current.jobs, job))
            try:
                await kv.update(PAUSE_PREFIX + tenant, changed.encode(), last=current.revision)
                return
            except KeyWrongLastSequenceError:
                continue

    async def clear(self, tenant: str, pause: TenantPause) -> bool:
        """Delete the tenant's pause if it is still ``pause`` (compare-and-set)."""
        kv = await self._kv()
        try:
            await kv.delete(PAUSE_PREFIX + tenant, last=pause.revision)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            return False
        self._pauses[tenant] = (time.monotonic(), None)
        return True
