"""JetStream state as gauges: consumer backlogs and each tenant's storage against its limit.

**Who publishes them.** The sink process (``services/sink/main.py`` runs
:func:`publish_jetstream_gauges` beside its consume loops); no other service reads
JetStream state. With several sink replicas each publishes the same values, so queries
aggregate with ``max by (stream, consumer)`` / ``max by (tenant)``.

**With what access.** The sink's MESH user reads, every ``MeshSettings.metrics_refresh_s``
seconds:

- ``$JS.API.CONSUMER.INFO.<stream>.<durable>`` for each shared consumer
  (:data:`shared.streams.MESH_CONSUMERS`) and each tenant's stage consumers
  (:func:`shared.streams.tenant_stage_consumers`, e.g. ``dedup-<tenant>``): ``num_pending`` ->
  ``crawlmesh_consumer_pending_messages``, ``num_ack_pending`` ->
  ``crawlmesh_consumer_ack_pending_messages``;
- each tenant's ``RESULTS`` and ``EVENTS`` stream info, through MESH's imports of the
  tenant's ``$JS.API.STREAM.INFO.<stream>`` exports (activation tokens issued to MESH
  alone, :mod:`shared.accounts.claims`): ``state.bytes`` summed ->
  ``crawlmesh_tenant_storage_bytes``; the tenant's storage quota (its account JWT's
  ``disk_storage``, from the ``tenants`` registry) -> ``crawlmesh_tenant_storage_limit_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import orjson
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.accounts.claims import stream_info_subject
from shared.settings import MeshSettings
from shared.streams import EVENTS, MESH_CONSUMERS, RESULTS, tenant_stage_consumers
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
    records = await TenantRegistry(js).records()
    per_tenant = [spec for record in records for spec in tenant_stage_consumers(record.id)]
    for spec in (*MESH_CONSUMERS, *per_tenant):
        try:
            info = await js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            continue
        consumers[(spec.stream, spec.durable)] = (info.num_pending or 0, info.num_ack_pending or 0)
    tenants: dict[str, tuple[int, int]] = {}
    for record in records:
        used = 0
        for stream in (RESULTS, EVENTS):
            try:
                reply = await js._nc.request(stream_info_subject(record.id, stream), b"",
                                             timeout=5.0)
                used += int(orjson.loads(reply.data).get("state", {}).get("bytes", 0))
            except Exception:  # no responders (stream deleted) or no answer: skip
                continue
        tenants[record.id] = (used, record.quota.storage_bytes)
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
