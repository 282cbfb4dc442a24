"""JetStream state as gauges: consumer backlogs and each tenant's storage against its limit.

**Who publishes them.** The sink process (``services/sink/main.py`` runs
:func:`publish_jetstream_gauges` beside its consume loops); no other service reads
JetStream state. With several sink replicas each publishes the same values, so queries
aggregate with ``max by (stream, consumer)`` / ``max by (tenant)``.

**With what access.** Today every stream lives in the MESH account, and the sink's MESH
user reads, every ``MeshSettings.metrics_refresh_s`` seconds, through MESH's JetStream API:

- ``$JS.API.CONSUMER.INFO.<stream>.<durable>`` for each MESH consumer
  (:data:`shared.streams.MESH_CONSUMERS`): ``num_pending`` ->
  ``crawlmesh_consumer_pending_messages``, ``num_ack_pending`` ->
  ``crawlmesh_consumer_ack_pending_messages``;
- ``$JS.API.STREAM.INFO.RESULTS_<tenant>`` and ``EVENTS_<tenant>`` for each registered
  tenant: ``state.bytes`` summed -> ``crawlmesh_tenant_storage_bytes``; the RESULTS
  stream's ``config.max_bytes`` -> ``crawlmesh_tenant_storage_limit_bytes`` (the tenant's
  quota until tenants have accounts);
- the ``tenants`` KV bucket, for the list of tenants.

Once tenants are NATS accounts (issue 4) their streams live in their own accounts: the
publisher then needs, besides MESH's JetStream API, read access to each tenant account's
JetStream API (``$JS.API.INFO`` there reports the account's storage used and its JetStream
storage limit, which replace the stream sum and RESULTS ``max_bytes``), e.g. a
monitoring user per tenant account allowed only ``$JS.API.INFO`` and
``$JS.API.STREAM.INFO.>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.settings import MeshSettings
from shared.streams import MESH_CONSUMERS, events_stream, results_stream
from shared.telemetry import metrics
from shared.tenancy import TenantRegistry

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class JetStreamSnapshot:
    """One reading: ``(stream, consumer) -> (pending, ack pending)`` messages and
    ``tenant -> (bytes used, limit bytes)``."""

    consumers: dict[tuple[str, str], tuple[int, int]]
    tenants: dict[str, tuple[int, int]]


async def read_snapshot(js: JetStreamContext, settings: MeshSettings) -> JetStreamSnapshot:
    """Read consumer and tenant storage state (a missing consumer or stream is skipped).

    Raises:
        nats.errors.Error / TimeoutError: the JetStream API did not answer.
    """
    consumers: dict[tuple[str, str], tuple[int, int]] = {}
    for spec in MESH_CONSUMERS:
        try:
            info = await js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            continue
        consumers[(spec.stream, spec.durable)] = (info.num_pending or 0, info.num_ack_pending or 0)
    tenants: dict[str, tuple[int, int]] = {}
    for tenant in (await TenantRegistry(js).all()).values():
        used, limit = 0, -1
        for stream in (results_stream(tenant, settings), events_stream(tenant, settings)):
            try:
                info = await js.stream_info(stream.name)
            except NotFoundError:
                continue
            used += info.state.bytes or 0
            if stream.name.startswith("RESULTS_"):
                limit = info.config.max_bytes if info.config.max_bytes is not None else -1
        tenants[tenant] = (used, limit)
    return JetStreamSnapshot(consumers, tenants)


def publish(snapshot: JetStreamSnapshot) -> None:
    """Replace the gauges' values with ``snapshot`` (series of vanished consumers or
    tenants are dropped; an unlimited stream reports no limit)."""
    for gauge in (metrics.CONSUMER_PENDING, metrics.CONSUMER_ACK_PENDING,
                  metrics.TENANT_STORAGE_BYTES, metrics.TENANT_STORAGE_LIMIT_BYTES):
        gauge.clear()
    for (stream, consumer), (pending, ack_pending) in snapshot.consumers.items():
        metrics.CONSUMER_PENDING.labels(stream, consumer).set(pending)
        metrics.CONSUMER_ACK_PENDING.labels(stream, consumer).set(ack_pending)
    for tenant, (used, limit) in snapshot.tenants.items():
        metrics.TENANT_STORAGE_BYTES.labels(tenant).set(used)
        if limit > 0:
            metrics.TENANT_STORAGE_LIMIT_BYTES.labels(tenant).set(limit)


async def publish_jetstream_gauges(nc: Client, settings: MeshSettings, stop: asyncio.Event) -> None:
    """Refresh the gauges every ``settings.metrics_refresh_s`` seconds until ``stop`` is set.

    A failed reading is logged and the previous values are kept until the next one.
    """
    js = nc.jetstream()
    while not stop.is_set():
        try:
            publish(await read_snapshot(js, settings))
        except Exception as error:
            log.warning("could not read JetStream state for the gauges: %r", error)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.metrics_refresh_s)
