"""Every Prometheus metric crawlmesh exports, defined once (names carry their units).

Labels are bounded: ``tenant`` (one per tenant), ``stage``/``consumer``/``stream`` (fixed
sets), ``outcome``/``decision``/``status_class`` (small enums). Never a URL; never a host.
The dashboard and alert rules under ``compose/`` may only query names defined here (a test
checks it).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# ---- the consume loop (every service) ----------------------------------------------------

MESSAGES = Counter(
    "crawlmesh_messages_total",
    "Messages settled by a consume loop, by stage, consumer, tenant and outcome "
    "(ack, nak, dead_letter).",
    ["stage", "consumer", "tenant", "outcome"],
)
HANDLER_DURATION = Histogram(
    "crawlmesh_handler_duration_seconds",
    "Time from a delivery's arrival to its settlement (handle + publish), seconds.",
    ["stage", "consumer"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
DEAD_LETTERS = Counter(
    "crawlmesh_dead_letters_total",
    "Messages dead-lettered, by the stage that gave up and tenant.",
    ["stage", "tenant"],
)

# ---- fetcher ----------------------------------------------------------------------------

BACKPRESSURE_WAITS = Counter(
    "crawlmesh_backpressure_waits_total",
    "Publishes refused because a tenant+job's subject in the next stage stream was at its cap "
    "(or the stream was full) and retried later, by publishing stage, tenant and full stage.",
    ["stage", "tenant", "full_stage"],
)

BACKPRESSURE_SECONDS = Counter(
    "crawlmesh_backpressure_seconds_total",
    "Time deliveries were held waiting for room in the next stage stream, seconds.",
    ["stage", "tenant"],
)

FETCH_DURATION = Histogram(
    "crawlmesh_fetch_duration_seconds",
    "HTTP fetch time (all redirect hops), seconds, by status class (2xx..5xx, error).",
    ["status_class"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
FETCH_RESPONSE_BYTES = Histogram(
    "crawlmesh_fetch_response_bytes",
    "Decompressed response body size, bytes, by status class.",
    ["status_class"],
    buckets=(0, 1024, 8192, 32768, 131072, 524288, 2097152, 10485760),
)
ROBOTS_DECISIONS = Counter(
    "crawlmesh_robots_decisions_total",
    "robots.txt decisions for fetched URLs (allowed, disallowed).",
    ["decision"],
)
POLITENESS_WAIT = Histogram(
    "crawlmesh_politeness_wait_seconds",
    "Time a fetch waited for its host's politeness slot, seconds.",
    buckets=(0, 0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60),
)
POLITENESS_DEFERRED = Counter(
    "crawlmesh_politeness_deferred_total",
    "Frontier entries re-published for later because their host was busy.",
)

# ---- dedup ------------------------------------------------------------------------------

DEDUP_LINKS = Counter(
    "crawlmesh_dedup_links_total",
    "Links decided by dedup, by tenant and decision (admitted, duplicate, out_of_scope, "
    "too_deep, over_budget, invalid).",
    ["tenant", "decision"],
)

# ---- sink -------------------------------------------------------------------------------

RESULTS_STORED = Counter(
    "crawlmesh_results_stored_total",
    "Page results delivered into tenants' RESULTS streams, by tenant and outcome.",
    ["tenant", "outcome"],
)
QUOTA_ERRORS = Counter(
    "crawlmesh_quota_errors_total",
    "Publishes into a tenant's streams refused by the server (storage full or quota).",
    ["tenant"],
)
JOBS_COMPLETED = Counter(
    "crawlmesh_jobs_completed_total",
    "Jobs announced completed, by tenant.",
    ["tenant"],
)

# ---- JetStream state (published by the sink, read with MESH's JetStream API) -------------

CONSUMER_PENDING = Gauge(
    "crawlmesh_consumer_pending_messages",
    "Messages not yet delivered to a consumer (backlog), from JetStream consumer info.",
    ["stream", "consumer"],
)
CONSUMER_ACK_PENDING = Gauge(
    "crawlmesh_consumer_ack_pending_messages",
    "Messages delivered but not yet acknowledged, from JetStream consumer info.",
    ["stream", "consumer"],
)
TENANT_STORAGE_BYTES = Gauge(
    "crawlmesh_tenant_storage_bytes",
    "Bytes a tenant's streams hold, from JetStream stream info.",
    ["tenant"],
)
TENANT_STORAGE_LIMIT_BYTES = Gauge(
    "crawlmesh_tenant_storage_limit_bytes",
    "The tenant's storage limit, bytes (its RESULTS stream max_bytes until accounts exist).",
    ["tenant"],
)


def status_class(status: int) -> str:
    """``2xx``..``5xx`` for an HTTP status, ``error`` for 0 (no response)."""
    return f"{status // 100}xx" if 100 <= status <= 599 else "error"
