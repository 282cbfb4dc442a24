"""Per-host politeness state shared by every fetcher: the ``hosts`` KV bucket.

One record per host (the politeness key ``host[:port]``), written by the fetcher that owns
the host's frontier partition (:mod:`services.fetcher.leases`) when a request starts, when
it ends and when the host is paused; read by a fetcher the first time it serves the host
after taking its partition, so a new owner honours the previous owner's next-due time,
``Retry-After`` pause and slow-down factor. Times are wall-clock seconds since the epoch
(owners may be different machines; monotonic clocks do not travel).

Record (JSON): ``{"next_due": t, "paused_until": t, "factor": f}``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from typing import Protocol

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from shared.streams import HOSTS_BUCKET

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^-_.A-Za-z0-9]")


def host_key(host: str) -> str:
    """KV key of ``host``: ``h.`` + the host with every character outside
    ``[-_.A-Za-z0-9]`` written ``=XX`` (hex), e.g. ``127.0.0.1:8080`` -> ``h.127.0.0.1=3a8080``."""
    return "h." + _UNSAFE.sub(lambda m: "".join(f"={b:02x}" for b in m.group().encode()),
                              host.lower())


@dataclass(frozen=True)
class HostRecord:
    """What a new owner of ``host`` must honour (wall-clock seconds)."""

    next_due: float = 0.0
    paused_until: float = 0.0
    factor: float = 1.0

    def to_bytes(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> HostRecord:
        raw = orjson.loads(data)
        return cls(float(raw.get("next_due", 0.0)), float(raw.get("paused_until", 0.0)),
                   float(raw.get("factor", 1.0)))


class HostStore(Protocol):
    async def get(self, host: str) -> HostRecord | None: ...

    async def put(self, host: str, record: HostRecord) -> None: ...


class KvHostStore:
    """:class:`HostRecord` s in the ``hosts`` bucket (the bucket's TTL forgets idle hosts)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv = None

    async def _bucket(self):  # type: ignore[no-untyped-def]
        if self._kv is None:
            self._kv = await self.js.key_value(HOSTS_BUCKET)
        return self._kv

    async def get(self, host: str) -> HostRecord | None:
        kv = await self._bucket()
        try:
            entry = await kv.get(host_key(host))
        except KeyNotFoundError:
            return None
        return HostRecord.from_bytes(entry.value or b"{}")

    async def put(self, host: str, record: HostRecord) -> None:
        kv = await self._bucket()
        await kv.put(host_key(host), record.to_bytes())


class MemoryHostStore:
    """In-process store (unit tests; two handlers sharing one store act like two owners)."""

    def __init__(self) -> None:
        self.records: dict[str, HostRecord] = {}

    async def get(self, host: str) -> HostRecord | None:
        return self.records.get(host)

    async def put(self, host: str, record: HostRecord) -> None:
        self.records[host] = record
