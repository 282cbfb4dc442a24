"""The one owner of every stream, consumer, KV bucket and object store definition.

Services call :func:`verify` and never invent a stream; ``crawlmesh init`` (and
``crawlmesh up``) call :func:`ensure_mesh` and :func:`ensure_tenant`, which are idempotent:
re-running them with changed settings updates replicas and limits in place.

Stage streams use work-queue retention (a message lives until acked or terminated) and a
duplicate window from :attr:`MeshSettings.duplicate_window_s`, at least as long as the
whole redelivery horizon. No stream allows roll-ups, per-message TTLs or schedules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from shared import subjects
from shared.settings import MeshSettings
from shared.subjects import Stage

ADVISORY_MAX_DELIVERIES = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"

# KV buckets
TENANTS_BUCKET = "tenants"
JOBS_BUCKET = "jobs"
PAGES_BUCKET = "pages"
ROBOTS_BUCKET = "robots"
ROBOTS_MAX_AGE_S = 86400.0
"""Life of a robots.txt record in ``ROBOTS_BUCKET`` (RFC 9309 §2.4: at most 24 hours)."""


_NO_ROLLUPS_TTLS_SCHEDULES: dict[str, bool] = {
    "allow_rollup_hdrs": False, "allow_msg_ttl": False, "allow_msg_schedules": False,
    "deny_purge": False, "deny_delete": False,
}
"""Every stream: no roll-up headers, per-message TTLs or schedules (DESIGN.md hazards);
message deletes and purges allowed (tenants delete consumed results)."""


class StreamMissingError(RuntimeError):
    """A stream or consumer a service needs does not exist (run ``crawlmesh init``)."""


@dataclass(frozen=True)
class StreamSpec:
    """A stream: its name, subjects and whether it is a work queue."""

    name: str
    subjects: tuple[str, ...]
    work_queue: bool = True
    max_age_s: float = 0.0
    max_bytes: int = -1
    description: str = ""
    per_subject_cap: bool = False


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer with explicit ack on one stream."""

    stream: str
    durable: str
    stage: Stage
    filter_subject: str | None = None
    unlimited_deliveries: bool = False
    extra: dict[str, object] = field(default_factory=dict)
    long_ack_wait: bool = False
    """Each backoff step at least ``settings.fetcher_ack_wait_s`` (see :func:`consumer_backoff`)."""


# ---- stage streams (MESH account) --------------------------------------------------------

LINKS = StreamSpec("LINKS", ("mesh.links.>",), description="discovered links -> dedup",
                   per_subject_cap=True)
FRONTIER = StreamSpec("FRONTIER", ("mesh.frontier.>",), description="admitted URLs -> fetcher")
"""Not capped per subject: the frontier is where a crawl's backlog lives, bounded by each
job's page budget (dedup admits at most ``max_pages``, itself at most the tenant's quota).
A cap here would close the cycle frontier -> fetcher -> FETCHED -> parser -> LINKS -> dedup
-> frontier: with every stage waiting for room downstream, nothing would drain."""
FETCHED = StreamSpec("FETCHED", ("mesh.fetched.>",), description="fetched pages -> parser",
                     per_subject_cap=True)
PARSED = StreamSpec("PARSED", ("mesh.parsed.>",), description="parsed pages -> sink",
                    per_subject_cap=True)
EXPANDED = StreamSpec("EXPANDED", ("mesh.expanded.>",), description="expansion reports -> sink")
DLQ = StreamSpec("DLQ", ("mesh.dlq.>",), work_queue=False, description="dead letters")
LEDGER = StreamSpec(
    "LEDGER", ("mesh.ledger.>",), work_queue=False,
    description="completion ledger: per-subject counts of admitted/finished pages per job",
)
PARKED = StreamSpec("PARKED", ("mesh.parked.>",), description="results parked over quota")
ADVISORIES = StreamSpec(
    "ADVISORIES",
    (f"{ADVISORY_MAX_DELIVERIES}.>",),
    max_age_s=7 * 86400,
    description="MAX_DELIVERIES advisories, so no exhausted message is missed",
)

MESH_STREAMS: tuple[StreamSpec, ...] = (
    LINKS, FRONTIER, FETCHED, PARSED, EXPANDED, DLQ, LEDGER, PARKED, ADVISORIES,
)


def intake_stream(tenant: str) -> StreamSpec:
    """One intake stream per tenant: no shared duplicate window, sequence or schedule."""
    return StreamSpec(f"INTAKE_{tenant}", (subjects.seeds(tenant),),
                      description=f"seed submissions of tenant {tenant}")


RESULTS = "RESULTS"
EVENTS = "EVENTS"
"""Stream names inside each tenant's own account (one account per tenant, so no suffix)."""


TENANT_RESULTS = StreamSpec(
    RESULTS, ("crawl.results.>",), work_queue=False,
    description="page results, in the tenant's own account (MESH writes via tenant.<tenant>.results.>)",
)
TENANT_EVENTS = StreamSpec(
    EVENTS, ("crawl.events.>",), work_queue=False,
    description="job events, in the tenant's own account (MESH writes via tenant.<tenant>.events.>)",
)
"""RESULTS and EVENTS as documented (:mod:`shared.asyncapi`); configs: :func:`tenant_stream_config`."""


def events_reserve_bytes(storage_bytes: int) -> int:
    """Bytes of a tenant's storage quota kept for its EVENTS stream: a tenant whose RESULTS
    are full must still receive the event saying so. 1/16 of the quota, 64 KiB..16 MiB."""
    return max(min(storage_bytes // 16, 16 << 20), min(64 << 10, storage_bytes // 2))


def tenant_stream_config(stream: str, settings: MeshSettings, storage_bytes: int) -> StreamConfig:
    """RESULTS or EVENTS in a tenant's account, sized from its storage quota.

    RESULTS gets the quota minus :func:`events_reserve_bytes`, EVENTS the reserve. Discard
    NEW (a full stream refuses, never drops old results), no roll-ups, TTLs or schedules;
    tenants may delete messages and purge, not change the configuration (their user
    permissions deny it; the sink checks).

    On a cluster every replica counts against the account's storage (nats-server reserves
    ``max_bytes`` x replicas), so with ``settings.replicas`` R each stream gets 1/R of its
    share: the quota is the disk the tenant uses across the cluster.
    """
    reserve = events_reserve_bytes(storage_bytes)
    if stream == RESULTS:
        subjects_, max_bytes = ["crawl.results.>"], max((storage_bytes - reserve) // settings.replicas, 1)
    elif stream == EVENTS:
        subjects_, max_bytes = ["crawl.events.>"], max(reserve // settings.replicas, 1)
    else:
        raise ValueError(f"not a tenant stream: {stream!r}")
    return StreamConfig(
        name=stream,
        description=f"{stream.lower()} of this tenant (written by crawlmesh)",
        subjects=subjects_,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=settings.replicas,
        max_bytes=max_bytes,
        max_age=settings.results_max_age_s,
        discard=DiscardPolicy.NEW,
        duplicate_window=settings.duplicate_window_s,
        **_NO_ROLLUPS_TTLS_SCHEDULES,  # type: ignore[arg-type]
    )


def tenant_stream_problem(config: StreamConfig, expected: StreamConfig) -> str | None:
    """Why a tenant stream's configuration is unsafe to write into, or None.

    A tenant stream must discard NEW (else a full stream silently drops old results),
    listen on its subjects, and allow no roll-ups, TTLs or schedules.
    """
    if config.discard != DiscardPolicy.NEW:
        return f"stream {config.name} discards {config.discard}, not new"
    if sorted(config.subjects or []) != sorted(expected.subjects or []):
        return f"stream {config.name} listens on {config.subjects}, not {expected.subjects}"
    if config.allow_rollup_hdrs or config.allow_msg_ttl or config.allow_msg_schedules:
        return f"stream {config.name} allows roll-ups, TTLs or schedules"
    if config.retention != RetentionPolicy.LIMITS:
        return f"stream {config.name} has retention {config.retention}, not limits"
    return None


def bodies_bucket(tenant: str) -> str:
    """Object Store bucket holding the tenant's large bodies."""
    return f"bodies_{tenant}"


# ---- consumers ---------------------------------------------------------------------------

SINK_DLQ = ConsumerSpec(DLQ.name, "sink-dlq", Stage.SINK)
DLQ_ADVISOR = ConsumerSpec(ADVISORIES.name, "dlq-advisor", Stage.SINK, unlimited_deliveries=True)


# ---- partitioned frontier: one consumer per partition, leases, host budgets (issue 5) -----
# FRONTIER is a work queue, so its consumers may not overlap: the single ``fetcher``
# consumer of earlier versions is replaced by one consumer per partition, pulled only by
# the fetcher holding that partition's lease (services/fetcher/leases.py). ensure_mesh
# deletes the old ``fetcher`` consumer (its unacked messages stay in FRONTIER and are
# delivered by the partition consumers).

LEGACY_FETCHER_DURABLE = "fetcher"
"""The former single fetcher consumer on FRONTIER (removed by :func:`ensure_mesh`)."""

LEASES_BUCKET = "leases"
"""Partition leases (``partition.<n>``) and fetcher heartbeats (``fetcher.<id>``)."""

HOSTS_BUCKET = "hosts"
"""Per-host politeness state shared by every fetcher (next-due time, pause, slow-down)."""

HOSTS_MAX_AGE_S = 7 * 86400.0
"""An idle host's record is forgotten after a week."""


def fetcher_partition(partition: int) -> ConsumerSpec:
    """The consumer of frontier partition ``partition`` (``fetcher-p<n>``)."""
    if not 0 <= partition < subjects.PARTITIONS:
        raise ValueError(f"partition {partition} outside 0..{subjects.PARTITIONS - 1}")
    return ConsumerSpec(FRONTIER.name, f"fetcher-p{partition}", Stage.FETCHER,
                        filter_subject=f"mesh.frontier.{partition}.>", long_ack_wait=True)


FETCHER_PARTITIONS: tuple[ConsumerSpec, ...] = tuple(
    fetcher_partition(p) for p in range(subjects.PARTITIONS))


async def _drop_legacy_fetcher(js: JetStreamContext) -> None:
    try:
        await js.delete_consumer(FRONTIER.name, LEGACY_FETCHER_DURABLE)
    except NotFoundError:
        pass

# ---- end of the partitioned frontier section ----------------------------------------------


MESH_CONSUMERS: tuple[ConsumerSpec, ...] = (*FETCHER_PARTITIONS, SINK_DLQ, DLQ_ADVISOR)
"""Consumers shared by all tenants. Dedup, parser and sink consume each tenant through its
own consumer (:func:`tenant_stage_consumers`), so tenants take turns instead of queueing
behind one another in one FIFO."""

LEGACY_CONSUMERS: tuple[tuple[str, str], ...] = (
    (LINKS.name, "dedup"), (FETCHED.name, "parser"), (PARSED.name, "sink"),
    (EXPANDED.name, "sink-expanded"),
)
"""Shared consumers of earlier versions, replaced by per-tenant ones: :func:`ensure_mesh`
deletes them (their pending messages stay in the work queue for the new consumers)."""


def dedup_consumer(tenant: str) -> ConsumerSpec:
    """Dedup's consumer of one tenant's discovered links."""
    return ConsumerSpec(LINKS.name, f"dedup-{tenant}", Stage.DEDUP,
                        filter_subject=f"mesh.links.{tenant}.>")


def parser_consumer(tenant: str) -> ConsumerSpec:
    """The parser's consumer of one tenant's fetched pages."""
    return ConsumerSpec(FETCHED.name, f"parser-{tenant}", Stage.PARSER,
                        filter_subject=f"mesh.fetched.{tenant}.>")


def sink_consumer(tenant: str) -> ConsumerSpec:
    """The sink's consumer of one tenant's parsed pages."""
    return ConsumerSpec(PARSED.name, f"sink-{tenant}", Stage.SINK,
                        filter_subject=f"mesh.parsed.{tenant}.>")


def sink_expanded_consumer(tenant: str) -> ConsumerSpec:
    """The sink's consumer of one tenant's page-expanded reports."""
    return ConsumerSpec(EXPANDED.name, f"sink-expanded-{tenant}", Stage.SINK,
                        filter_subject=f"mesh.expanded.{tenant}.>")


def tenant_stage_consumers(tenant: str) -> tuple[ConsumerSpec, ...]:
    """Every per-tenant consumer of the stage streams (created with the tenant)."""
    return (dedup_consumer(tenant), parser_consumer(tenant), sink_consumer(tenant),
            sink_expanded_consumer(tenant))


def seeder_consumer(tenant: str) -> ConsumerSpec:
    return ConsumerSpec(intake_stream(tenant).name, "seeder", Stage.SEEDER)


def parked_consumer(tenant: str) -> ConsumerSpec:
    """The sink's consumer of one tenant's parked results: one in flight at a time (the
    head probes whether the tenant has room again), redelivered without limit."""
    return ConsumerSpec(
        PARKED.name, f"sink-parked-{tenant}", Stage.SINK,
        filter_subject=f"mesh.parked.{tenant}.>", unlimited_deliveries=True,
        extra={"max_ack_pending": 1},
    )


# ---- building configs --------------------------------------------------------------------


def stream_config(spec: StreamSpec, settings: MeshSettings) -> StreamConfig:
    """The full JetStream config of ``spec`` under ``settings``."""
    per_subject = settings.stage_max_msgs_per_subject if spec.per_subject_cap else -1
    max_bytes = spec.max_bytes
    if spec.work_queue and max_bytes < 0:
        max_bytes = settings.stage_max_bytes
    if spec is DLQ:
        max_age = settings.dlq_max_age_s
    else:
        max_age = spec.max_age_s
    return StreamConfig(
        name=spec.name,
        description=spec.description or None,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS,
        storage=StorageType.FILE if settings.storage == "file" else StorageType.MEMORY,
        num_replicas=settings.replicas,
        max_bytes=max_bytes,
        max_age=max_age,
        max_msgs_per_subject=per_subject,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=per_subject > 0,
        duplicate_window=settings.duplicate_window_s,
        **_NO_ROLLUPS_TTLS_SCHEDULES,  # type: ignore[arg-type]
    )


def consumer_backoff(spec: ConsumerSpec, settings: MeshSettings) -> tuple[float, ...]:
    """The redelivery delays of ``spec``'s consumer, seconds, by delivery (the first is its
    ack wait): ``settings.backoff_s``, each step raised to ``settings.fetcher_ack_wait_s`` for
    a ``long_ack_wait`` consumer. Measured on this 2-core machine under load: with a 2 s
    ack wait, 28 of 3,293 frontier deliveries were redeliveries of entries still being
    handled (their heartbeat late), and 2 pages were requested a third time; with 10 s,
    none."""
    if spec.long_ack_wait:
        return tuple(max(step, settings.fetcher_ack_wait_s) for step in settings.backoff_s)
    return settings.backoff_s


def consumer_config(spec: ConsumerSpec, settings: MeshSettings) -> ConsumerConfig:
    """Durable pull consumer, explicit ack, ``max_deliver`` and backoff from settings."""
    if spec.unlimited_deliveries:
        return ConsumerConfig(**{
            "durable_name": spec.durable, "ack_policy": "explicit", "max_deliver": -1,
            "ack_wait": 30.0, "max_ack_pending": settings.max_ack_pending,
            "filter_subject": spec.filter_subject, **spec.extra,  # type: ignore[arg-type]
        })
    return ConsumerConfig(
        durable_name=spec.durable,
        ack_policy="explicit",
        deliver_policy="all",
        max_deliver=settings.max_deliver,
        backoff=list(consumer_backoff(spec, settings)),
        ack_wait=consumer_backoff(spec, settings)[0],
        max_ack_pending=settings.max_ack_pending,
        filter_subject=spec.filter_subject,
        **spec.extra,  # type: ignore[arg-type]
    )


# ---- ensure / verify ---------------------------------------------------------------------


async def ensure_stream(js: JetStreamContext, spec: StreamSpec, settings: MeshSettings) -> None:
    """Create ``spec``'s stream, or update it in place to match ``settings``."""
    config = stream_config(spec, settings)
    try:
        await js.stream_info(spec.name)
    except NotFoundError:
        await js.add_stream(config)
        return
    await js.update_stream(config)


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec, settings: MeshSettings) -> None:
    """Create or update ``spec``'s durable consumer (JetStream's create is an upsert)."""
    await js.add_consumer(spec.stream, consumer_config(spec, settings))


async def ensure_mesh(js: JetStreamContext, settings: MeshSettings) -> None:
    """Create or update every MESH stream, consumer and KV bucket. Idempotent."""
    for spec in MESH_STREAMS:
        await ensure_stream(js, spec, settings)
    await _drop_legacy_fetcher(js)
    for consumer in MESH_CONSUMERS:
        await ensure_consumer(js, consumer, settings)
    for stream, durable in LEGACY_CONSUMERS:
        try:
            await js.delete_consumer(stream, durable)
        except NotFoundError:
            pass
    for bucket, history in ((TENANTS_BUCKET, 1), (JOBS_BUCKET, 5), (PAGES_BUCKET, 1)):
        await ensure_kv(js, bucket, settings, history=history)
    await ensure_kv(js, ROBOTS_BUCKET, settings, ttl_s=ROBOTS_MAX_AGE_S)
    await ensure_kv(js, LEASES_BUCKET, settings)
    await ensure_kv(js, HOSTS_BUCKET, settings, ttl_s=HOSTS_MAX_AGE_S)


async def ensure_kv(
    js: JetStreamContext, bucket: str, settings: MeshSettings, *, history: int = 1,
    ttl_s: float | None = None,
) -> None:
    """Create the KV bucket if absent (its settings are checked, not silently changed)."""
    config = KeyValueConfig(
        bucket=bucket, history=history, ttl=ttl_s, replicas=settings.replicas,
        storage=StorageType.FILE if settings.storage == "file" else StorageType.MEMORY,
    )
    try:
        await js.key_value(bucket)
    except (NotFoundError, BadRequestError):
        await js.create_key_value(config)


async def ensure_tenant(js: JetStreamContext, tenant: str, settings: MeshSettings) -> None:
    """Create or update the MESH side of a tenant: its intake stream and seeder consumer,
    the sink's parked-results consumer, and its body Object Store bucket. Idempotent.
    (RESULTS and EVENTS live in the tenant's own account: :func:`ensure_tenant_streams`.)"""
    await ensure_stream(js, intake_stream(tenant), settings)
    await ensure_consumer(js, seeder_consumer(tenant), settings)
    await ensure_consumer(js, parked_consumer(tenant), settings)
    for consumer in tenant_stage_consumers(tenant):
        await ensure_consumer(js, consumer, settings)
    try:
        await js.object_store(bodies_bucket(tenant))
    except (NotFoundError, BadRequestError):
        await js.create_object_store(
            bodies_bucket(tenant),
            ObjectStoreConfig(
                ttl=settings.body_ttl_s, replicas=settings.replicas,
                storage=StorageType.FILE if settings.storage == "file" else StorageType.MEMORY,
            ),
        )


async def ensure_tenant_streams(
    tenant_js: JetStreamContext, settings: MeshSettings, storage_bytes: int,
) -> None:
    """Create or resize RESULTS and EVENTS in a tenant's account (``tenant_js`` is a
    connection of that account). Lowering below current use keeps every message and
    refuses new ones until use falls. Idempotent."""
    for stream in (RESULTS, EVENTS):
        config = tenant_stream_config(stream, settings, storage_bytes)
        try:
            await tenant_js.stream_info(stream)
        except NotFoundError:
            await tenant_js.add_stream(config)
            continue
        await tenant_js.update_stream(config)


async def remove_tenant(js: JetStreamContext, tenant: str) -> None:
    """Delete the MESH side of a tenant: its intake stream, parked consumer, body bucket,
    and its messages in every stage stream, the dead letters, parked results and ledger."""
    for name in (intake_stream(tenant).name,):
        try:
            await js.delete_stream(name)
        except NotFoundError:
            pass
    for spec in (parked_consumer(tenant), *tenant_stage_consumers(tenant)):
        try:
            await js.delete_consumer(spec.stream, spec.durable)
        except NotFoundError:
            pass
    filters = {
        LINKS.name: f"mesh.links.{tenant}.>", FRONTIER.name: f"mesh.frontier.*.{tenant}.>",
        FETCHED.name: f"mesh.fetched.{tenant}.>", PARSED.name: f"mesh.parsed.{tenant}.>",
        EXPANDED.name: f"mesh.expanded.{tenant}.>", DLQ.name: f"mesh.dlq.*.{tenant}.>",
        LEDGER.name: f"mesh.ledger.{tenant}.>", PARKED.name: f"mesh.parked.{tenant}.>",
    }
    for stream, subject in filters.items():
        try:
            await js.purge_stream(stream, subject=subject)
        except NotFoundError:
            pass
    try:
        await js.delete_object_store(bodies_bucket(tenant))
    except (NotFoundError, BadRequestError):
        pass


async def verify(js: JetStreamContext, consumers: tuple[ConsumerSpec, ...]) -> None:
    """Check that each consumer and its stream exist; services never create them.

    Raises:
        StreamMissingError: naming the missing stream or consumer.
    """
    for spec in consumers:
        try:
            await js.stream_info(spec.stream)
        except NotFoundError:
            raise StreamMissingError(
                f"stream {spec.stream} does not exist (run `crawlmesh init`)"
            ) from None
        try:
            await js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            raise StreamMissingError(
                f"consumer {spec.durable} on {spec.stream} does not exist (run `crawlmesh init`)"
            ) from None
