"""Admitting URLs once per job: a KV create-if-absent per URL, page budgets by CAS.

Keys in the ``pages`` bucket: ``<tenant>.<job>.<fingerprint>`` for each URL (value
``admitted <msg id of the admitting message>``, later advanced by the sink), and
``<tenant>.<job>._budget`` / ``<tenant>.<job>._host_<hash>`` for the page budgets.

Budgets are reserved before URLs are created and unused reservations are released, so a
job never admits more than ``max_pages`` (or ``max_pages_per_host`` for a host). A process
that dies between reserving and creating leaks its reservation: after a crash a job may
admit slightly fewer pages than its budget, never more.

An in-process LRU cache of fingerprints already decided spares the round trip for the
~55 links per page that are mostly duplicates.

Refused candidates count in ``crawlmesh_dedup_links_total``: ``duplicate`` (another
message admitted it) or ``over_budget`` (no page budget left).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from shared.streams import PAGES_BUCKET
from shared.telemetry import metrics

ADMITTED = "admitted"
NO_OWNER = "-"
"""Cached for a fingerprint refused for lack of budget (no message admitted it)."""
DUPLICATE = "duplicate"
OVER_BUDGET = "over_budget"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A canonical URL that passed scope checks, waiting for admission."""

    fingerprint: str
    host: str


class DecisionCache:
    """LRU of ``(tenant, job, fingerprint) -> admitting msg id`` (bounded entries)."""

    def __init__(self, max_entries: int = 500_000) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str, str], str] = OrderedDict()

    def get(self, key: tuple[str, str, str]) -> str | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: tuple[str, str, str], cause: str) -> None:
        self._entries[key] = cause
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


def _count(tenant: str, refused: Counter[str]) -> None:
    for decision, count in refused.items():
        metrics.DEDUP_LINKS.labels(tenant, decision).inc(count)


class KvAdmission:
    """The seen-set and page budgets in the ``pages`` KV bucket (see module docstring)."""

    def __init__(self, js: JetStreamContext, cache: DecisionCache | None = None) -> None:
        self.js = js
        self.cache = cache or DecisionCache()

    async def admit(
        self, tenant: str, job: str, candidates: list[Candidate], cause: str,
        max_pages: int, max_pages_per_host: int,
    ) -> list[Candidate]:
        """Admit the new candidates (and those ``cause`` itself admitted before).

        Returns the admitted candidates, in input order.
        """
        kv = await self.js.key_value(PAGES_BUCKET)
        undecided: list[Candidate] = []
        admitted: list[Candidate] = []
        refused: Counter[str] = Counter()
        for cand in candidates:
            known = self.cache.get((tenant, job, cand.fingerprint))
            if known is None:
                undecided.append(cand)
            elif known == cause:
                admitted.append(cand)
            else:
                refused[OVER_BUDGET if known == NO_OWNER else DUPLICATE] += 1
        if not undecided:
            _count(tenant, refused)
            return admitted
        # Host caps first, then the job's budget: a cut by the budget before the host caps
        # would spend it on links that a host cap then refuses, starving the other hosts.
        wanted = undecided
        if max_pages_per_host > 0:
            wanted = await self._reserve_hosts(kv, tenant, job, wanted, max_pages_per_host)
        granted = await self._reserve(kv, f"{tenant}.{job}._budget", len(wanted), max_pages) \
            if wanted else 0
        if max_pages_per_host > 0 and granted < len(wanted):
            await self._release_hosts(kv, tenant, job, wanted[granted:])
        wanted = wanted[:granted]
        chosen = {c.fingerprint for c in wanted}
        fresh: set[str] = set()
        for cand in undecided:
            key = f"{tenant}.{job}.{cand.fingerprint}"
            if cand.fingerprint in chosen:
                try:
                    await kv.create(key, f"{ADMITTED} {cause}".encode())
                    fresh.add(cand.fingerprint)
                    self.cache.put((tenant, job, cand.fingerprint), cause)
                    admitted.append(cand)
                    continue
                except KeyWrongLastSequenceError:
                    pass
            # Already decided, or over budget: admitted only if this very message did it
            # before (a redelivery republishes instead of calling it a duplicate).
            owner = await self._owner(kv, key)
            self.cache.put((tenant, job, cand.fingerprint), owner or NO_OWNER)
            if owner == cause:
                admitted.append(cand)
            else:
                refused[DUPLICATE if owner else OVER_BUDGET] += 1
        if len(fresh) < len(wanted):
            await self._release(kv, f"{tenant}.{job}._budget", len(wanted) - len(fresh))
        if max_pages_per_host > 0:
            await self._release_hosts(kv, tenant, job, [c for c in wanted if c.fingerprint not in fresh])
        _count(tenant, refused)
        order = {c.fingerprint: i for i, c in enumerate(candidates)}
        return sorted(admitted, key=lambda c: order[c.fingerprint])

    async def _owner(self, kv, key: str) -> str | None:  # type: ignore[no-untyped-def]
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        value = (entry.value or b"").decode()
        # "admitted <cause>" while queued; the sink later rewrites it as "<state> <cause>".
        return value.split(" ", 1)[1] if " " in value else None

    async def _reserve(self, kv, key: str, want: int, limit: int) -> int:  # type: ignore[no-untyped-def]
        """Add up to ``want`` to counter ``key`` without passing ``limit``; return the grant."""
        for _ in range(100):
            try:
                entry = await kv.get(key)
                used, revision = int(entry.value or b"0"), entry.revision
            except KeyNotFoundError:
                used, revision = 0, None
            grant = max(0, min(want, limit - used))
            if grant == 0:
                return 0
            try:
                if revision is None:
                    await kv.create(key, str(used + grant).encode())
                else:
                    await kv.update(key, str(used + grant).encode(), last=revision)
                return grant
            except KeyWrongLastSequenceError:
                continue
        return 0

    async def _release(self, kv, key: str, count: int) -> None:  # type: ignore[no-untyped-def]
        for _ in range(100):
            entry = await kv.get(key)
            value = max(0, int(entry.value or b"0") - count)
            try:
                await kv.update(key, str(value).encode(), last=entry.revision)
                return
            except KeyWrongLastSequenceError:
                continue

    @staticmethod
    def _host_key(tenant: str, job: str, host: str) -> str:
        digest = hashlib.blake2b(host.encode(), digest_size=8).hexdigest()
        return f"{tenant}.{job}._host_{digest}"

    async def _reserve_hosts(  # type: ignore[no-untyped-def]
        self, kv, tenant: str, job: str, wanted: list[Candidate], limit: int
    ) -> list[Candidate]:
        by_host: dict[str, list[Candidate]] = {}
        for cand in wanted:
            by_host.setdefault(cand.host, []).append(cand)
        kept: set[str] = set()
        for host, group in by_host.items():
            grant = await self._reserve(kv, self._host_key(tenant, job, host), len(group), limit)
            kept.update(c.fingerprint for c in group[:grant])
        return [c for c in wanted if c.fingerprint in kept]

    async def _release_hosts(  # type: ignore[no-untyped-def]
        self, kv, tenant: str, job: str, unused: list[Candidate]
    ) -> None:
        counts: dict[str, int] = {}
        for cand in unused:
            counts[cand.host] = counts.get(cand.host, 0) + 1
        for host, count in counts.items():
            await self._release(kv, self._host_key(tenant, job, host), count)
