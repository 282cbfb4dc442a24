"""Parser service entry: the handler wired to the body Object Store and the ``jobs`` KV."""

from __future__ import annotations

import logging
from collections import OrderedDict

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    DigestMismatchError,
    KeyDeletedError,
    KeyNotFoundError,
    ObjectDeletedError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from services.parser.handler import BodyUnavailableError, ParserHandler
from services.parser.settings import ParserSettings
from shared.bus.outcomes import TransientError
from shared.bus.service import LoopSpec, TenantLoops
from shared.codec import DecodeError, decode
from shared.contracts import BodyRef, ExtractionRule, FetchedPage, JobRecord
from shared.settings import MeshSettings
from shared.streams import JOBS_BUCKET, parser_consumer

log = logging.getLogger(__name__)


class ObjectStoreBodies:
    """Bodies in the tenants' Object Store buckets (``bodies_<tenant>``)."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._stores: dict[str, ObjectStore] = {}

    async def read(self, ref: BodyRef) -> bytes:
        try:
            store = self._stores.get(ref.bucket)
            if store is None:
                store = self._stores[ref.bucket] = await self.js.object_store(ref.bucket)
            result = await store.get(ref.name)
        except (BucketNotFoundError, ObjectNotFoundError, ObjectDeletedError,
                DigestMismatchError) as error:
            raise BodyUnavailableError(f"{ref.bucket}/{ref.name}: {error!r}") from None
        return result.data or b""


class KvJobRules:
    """Each job's extraction rules, read once from its record in the ``jobs`` KV bucket.

    Rules never change during a job, so up to ``max_jobs`` jobs are cached (least recently
    used dropped first). A job without a record gets no rules (and is asked again later).
    """

    def __init__(self, js: JetStreamContext, max_jobs: int = 1024) -> None:
        self.js = js
        self.max_jobs = max_jobs
        self._kv: KeyValue | None = None
        self._cache: OrderedDict[tuple[str, str], tuple[ExtractionRule, ...]] = OrderedDict()

    async def rules(self, tenant: str, job: str) -> tuple[ExtractionRule, ...]:
        """Raises TransientError if the record cannot be decoded (e.g. mid-upgrade)."""
        key = (tenant, job)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        if self._kv is None:
            self._kv = await self.js.key_value(JOBS_BUCKET)
        try:
            entry = await self._kv.get(f"{tenant}.{job}")
        except (KeyNotFoundError, KeyDeletedError):
            log.warning("no job record for %s.%s: parsing without extraction rules", tenant, job)
            return ()
        try:
            rules = decode(entry.value or b"", JobRecord).request.rules
        except DecodeError as error:
            raise TransientError(f"job record {tenant}.{job} unreadable: {error}") from None
        self._cache[key] = rules
        if len(self._cache) > self.max_jobs:
            self._cache.popitem(last=False)
        return rules


async def setup(nc: Client, settings: MeshSettings) -> list[TenantLoops]:
    """One loop per tenant (its own consumer on FETCHED), sharing ``settings.concurrency``
    handler slots handed out in arrival order: tenants take turns (round-robin draining)."""
    js = nc.jetstream()
    handler = ParserHandler(ObjectStoreBodies(js), KvJobRules(js), ParserSettings().limits())

    def pages(tenant: str) -> LoopSpec:
        return LoopSpec(parser_consumer(tenant), FetchedPage, handler)

    return [TenantLoops("parser", pages, shared_slots=settings.concurrency)]
