"""Subject names with fixed token positions, the frontier partition hash and message ids.

Token positions never change (DESIGN.md "Accounts and subjects"), so accounts and the
partitioned frontier need no renaming later::

    crawl.seeds.<tenant>                       intake (MESH account)
    mesh.links.<tenant>.<job>                  discovered links -> dedup
    mesh.frontier.<partition>.<tenant>.<job>   admitted URLs -> fetcher
    mesh.fetched.<tenant>.<job>                fetched pages -> parser
    mesh.parsed.<tenant>.<job>                 parsed pages -> sink
    mesh.expanded.<tenant>.<job>               "page expanded, n admitted" -> sink
    mesh.dlq.<stage>.<tenant>.<job>            dead letters
    mesh.parked.<tenant>.<job>                 results parked while a tenant is over quota
    mesh.ledger.<tenant>.<job>.<kind>          completion ledger (admitted/finished/failed/seeded)
    tenant.<tenant>.results.<job>              results, delivered into the tenant's RESULTS
    tenant.<tenant>.events.<job>               job events, into the tenant's EVENTS

A tenant is an opaque id shaped like a NATS account public key; a job id is a short
time-ordered token. Neither may contain ``.``, ``*``, ``>`` or whitespace.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum

PARTITIONS = 64
"""Fixed number of frontier partitions (P). Changing it re-homes every host: don't."""

_MESH_KINDS = frozenset({"links", "fetched", "parsed", "expanded", "parked"})

NO_JOB = "none"
"""Job token used for intake messages that belong to no job yet."""

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Stage(StrEnum):
    """The service that consumes a stream; used in dead-letter subjects and message ids."""

    SEEDER = "seeder"
    DEDUP = "dedup"
    FETCHER = "fetcher"
    PARSER = "parser"
    SINK = "sink"


class SubjectError(ValueError):
    """A subject or token does not have the expected shape."""


def check_token(value: str, what: str) -> str:
    """Return ``value`` if it is a valid subject token (``[A-Za-z0-9_-]{1,64}``).

    Raises:
        SubjectError: naming ``what`` and the offending value.
    """
    if not _TOKEN.match(value):
        raise SubjectError(f"invalid {what} {value!r}: expected 1-64 of [A-Za-z0-9_-]")
    return value


def new_job_id() -> str:
    """A new job id: 12 hex digits of milliseconds since the epoch + 8 random hex digits."""
    return f"{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


def partition_of(host: str) -> int:
    """Stable frontier partition of a host: first 8 bytes of BLAKE2b mod :data:`PARTITIONS`.

    Never Python's ``hash()``, which is salted per process.
    """
    digest = hashlib.blake2b(host.lower().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % PARTITIONS


def seeds(tenant: str) -> str:
    return f"crawl.seeds.{check_token(tenant, 'tenant')}"


def links(tenant: str, job: str) -> str:
    return f"mesh.links.{tenant}.{job}"


def frontier(partition: int, tenant: str, job: str) -> str:
    if not 0 <= partition < PARTITIONS:
        raise SubjectError(f"partition {partition} outside 0..{PARTITIONS - 1}")
    return f"mesh.frontier.{partition}.{tenant}.{job}"


def fetched(tenant: str, job: str) -> str:
    return f"mesh.fetched.{tenant}.{job}"


def parsed(tenant: str, job: str) -> str:
    return f"mesh.parsed.{tenant}.{job}"


def expanded(tenant: str, job: str) -> str:
    return f"mesh.expanded.{tenant}.{job}"


def dlq(stage: Stage | str, tenant: str, job: str) -> str:
    return f"mesh.dlq.{Stage(stage)}.{tenant}.{job}"


def parked(tenant: str, job: str) -> str:
    return f"mesh.parked.{tenant}.{job}"


class LedgerKind(StrEnum):
    """Entries of the completion ledger; one per page (or per job for ``seeded``)."""

    ADMITTED = "admitted"
    FINISHED = "finished"
    FAILED = "failed"
    SEEDED = "seeded"


def ledger(tenant: str, job: str, kind: LedgerKind | str) -> str:
    return f"mesh.ledger.{tenant}.{job}.{LedgerKind(kind)}"


def results(tenant: str, job: str) -> str:
    """Mesh-side subject whose messages land in the tenant's RESULTS stream."""
    return f"tenant.{tenant}.results.{job}"


def events(tenant: str, job: str) -> str:
    """Mesh-side subject whose messages land in the tenant's EVENTS stream."""
    return f"tenant.{tenant}.events.{job}"


@dataclass(frozen=True, slots=True)
class Route:
    """Tenant and job read back from a subject's fixed token positions."""

    kind: str
    tenant: str
    job: str


def parse(subject: str) -> Route:
    """Read kind, tenant and job out of any crawlmesh subject.

    Works on payloads that failed validation, so a dead letter always has its tenant/job.

    Raises:
        SubjectError: if the subject is not one of the shapes in this module's docstring.
    """
    tokens = subject.split(".")
    route: Route | None = None
    match tokens:
        case ["crawl", "seeds", tenant]:
            route = Route("seeds", tenant, NO_JOB)
        case ["mesh", "frontier", partition, tenant, job] if partition.isdigit() and int(
            partition
        ) < PARTITIONS:
            route = Route("frontier", tenant, job)
        case ["mesh", "dlq", stage, tenant, job] if stage in Stage.__members__.values():
            route = Route("dlq", tenant, job)
        case ["mesh", "ledger", tenant, job, kind] if kind in LedgerKind.__members__.values():
            route = Route("ledger", tenant, job)
        case ["mesh", kind, tenant, job] if kind in _MESH_KINDS:
            route = Route(kind, tenant, job)
        case ["tenant", tenant, kind, job] if kind in ("results", "events"):
            route = Route(kind, tenant, job)
    if route and _TOKEN.match(route.tenant) and _TOKEN.match(route.job):
        return route
    raise SubjectError(f"not a crawlmesh subject: {subject!r}")


def msg_id(stage: Stage | str, tenant: str, job: str, fingerprint: str, generation: int = 0) -> str:
    """Deterministic ``Nats-Msg-Id``: ``stage:tenant:job:fingerprint[:generation]``.

    Generation 0 is omitted; anything re-published on purpose after the duplicate window
    (a rescheduled URL, a replayed dead letter) carries a higher generation.
    """
    base = f"{stage}:{tenant}:{job}:{fingerprint}"
    return f"{base}:{generation}" if generation else base
