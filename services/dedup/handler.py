"""The dedup handler: discovered links in; frontier entries and one expansion report out."""

from __future__ import annotations

from typing import Protocol

from shared import subjects
from shared.bus.loop import Delivery, Outbound
from shared.contracts import DiscoveredLinks, FrontierEntry, PageExpanded
from shared.subjects import Stage
from shared.urls import UrlError, canonical_url, fingerprint, host_of


class SeenSet(Protocol):
    """Per-job admission: atomic create-if-absent recording which message admitted a URL."""

    async def admit(self, tenant: str, job: str, fingerprint: str, admitted_by: str) -> bool:
        """True if this URL is new for the job, or was admitted by ``admitted_by`` itself
        (a redelivery republishes rather than calling its own admission a duplicate)."""
        ...


class DedupHandler:
    """Admits each canonical URL once per job (see module docstring)."""

    def __init__(self, seen: SeenSet) -> None:
        self.seen = seen

    async def handle(self, message: DiscoveredLinks, delivery: Delivery) -> list[Outbound]:
        tenant, job = message.tenant, message.job_id
        source = message.source_fingerprint or "seeds"
        cause = subjects.msg_id(Stage.DEDUP, tenant, job, f"from-{source}-{message.part}")
        outputs: list[Outbound] = []
        admitted: list[str] = []
        batch: set[str] = set()
        for link in message.links:
            try:
                url = canonical_url(link.url)
            except UrlError:
                continue
            fp = fingerprint(url)
            if fp in batch:
                continue
            batch.add(fp)
            if not await self.seen.admit(tenant, job, fp, cause):
                continue
            admitted.append(fp)
            host = host_of(url)
            entry = FrontierEntry(
                tenant=tenant, job_id=job, url=url, fingerprint=fp, host=host,
                depth=message.depth,
            )
            outputs.append(Outbound(
                subjects.frontier(subjects.partition_of(host), tenant, job), entry,
                subjects.msg_id(Stage.DEDUP, tenant, job, fp),
            ))
        report = PageExpanded(
            tenant=tenant, job_id=job, fingerprint=message.source_fingerprint,
            links_seen=len(message.links), admitted=len(admitted),
            admitted_fingerprints=tuple(admitted),
        )
        outputs.append(Outbound(subjects.expanded(tenant, job), report, cause))
        return outputs
