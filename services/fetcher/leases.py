"""Frontier partitions shared among fetchers, one owner each: leases and heartbeats in KV.

Design (DESIGN.md "Frontier and politeness"). The frontier has P = 64 partitions (a stable
hash of the host). FRONTIER has one durable pull consumer per partition, ``fetcher-p<n>``
filtered on ``mesh.frontier.<n>.>`` (:data:`shared.streams.FETCHER_PARTITIONS`, created by
``ensure_mesh``), and **only the fetcher holding partition n's lease pulls from
fetcher-p<n>**. So every host is served by one fetcher at a time, which keeps the host's
budget (:mod:`services.fetcher.politeness`) and mirrors it in the ``hosts`` bucket for the
next owner. We chose this over the server's ``pinned_client`` priority groups because
nats-py has no client support for them (raw API requests and pin-id headers on every
pull), and over one shared consumer with hand-off of individual messages because a
consumer per partition makes "who may see a message" a property of the subscription, not
of every message.

Leases live in the ``leases`` bucket (:data:`shared.streams.LEASES_BUCKET`):

- ``fetcher.<id>`` -> ``{"expires": t}``: each live fetcher's heartbeat;
- ``partition.<n>`` -> ``{"owner": id, "expires": t}`` (owner ``""``: free), changed only
  by compare-and-set on the key's revision (create when absent).

Times in values are wall-clock seconds since the epoch. Every ``lease_s / 3`` seconds each
fetcher (:meth:`PartitionLeases.tick`): renews its heartbeat and each partition it holds
(CAS; a failed CAS means it lost the partition); counts the live fetchers (heartbeat not
expired) and takes as its share ``ceil(64 / live)``; above its share it releases its
highest-numbered extra partitions (once their
in-flight requests are over: the lease is renewed meanwhile, but no longer trusted for new
requests); below it, it claims free partitions and those whose
lease expired more than ``grace`` ago (CAS, so two claimants cannot both win), starting at
a point that depends on its id so claimants spread out. A crashed fetcher stops renewing:
its heartbeat and leases expire after ``lease_s`` and its partitions are claimed on the
next tick of the others, about ``lease_s * (1 + 1/3) + grace`` after its last renewal.

Validity: a lease renewed by a write *sent* at monotonic time ``t`` is trusted locally until
``t + lease_s - guard``, earlier than anyone else may claim it (its value says
``wall(t) + lease_s``, claimable after ``+ grace``), so two fetchers never both believe they
hold a partition as long as clocks differ by less than ``guard + grace``. A partition being
released is no longer trusted at once. The handler checks :meth:`PartitionLeases.holds`
before robots.txt, while an entry waits and right before each request; an entry of a
partition no longer held is re-published (new generation, acked) for the new owner, never
fetched and never nak'd (which would burn ``max_deliver``). Messages delivered to a
fetcher stay pending on its consumer until it acks them, so no other fetcher gets the same
delivery meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from shared.streams import LEASES_BUCKET
from shared.subjects import PARTITIONS

log = logging.getLogger(__name__)


def new_owner_id() -> str:
    """A fetcher id: host name, pid and 4 random hex digits (a KV key token)."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:32]
    return f"{host}-{os.getpid()}-{os.urandom(2).hex()}"


def partition_key(partition: int) -> str:
    return f"partition.{partition}"


def heartbeat_key(owner: str) -> str:
    return f"fetcher.{owner}"


@dataclass
class _Held:
    revision: int
    valid_until: float  # monotonic
    releasing: bool = False


class PartitionLeases:
    """This fetcher's view of the partition leases (see module docstring).

    Args:
        js: JetStream context of the MESH account.
        owner: this fetcher's id.
        lease_s: lease period, seconds.
        partitions: number of partitions (P).
    """

    def __init__(self, js: JetStreamContext, owner: str, lease_s: float,
                 partitions: int = PARTITIONS, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.js = js
        self.owner = owner
        self.lease_s = lease_s
        self.partitions = partitions
        self.clock = clock
        self.wall = wall
        self.guard_s = lease_s / 4
        self.grace_s = lease_s / 4
        self.held: dict[int, _Held] = {}
        self.live: int = 1
        self._kv = None
        self._start = int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=4).digest(),
                                     "big") % partitions

    @property
    def tick_s(self) -> float:
        return self.lease_s / 3

    async def _bucket(self):  # type: ignore[no-untyped-def]
        if self._kv is None:
            self._kv = await self.js.key_value(LEASES_BUCKET)
        return self._kv

    def holds(self, partition: int) -> bool:
        """True if this fetcher may serve ``partition`` right now."""
        held = self.held.get(partition)
        return held is not None and not held.releasing and self.clock() < held.valid_until

    def owned(self) -> set[int]:
        """Partitions held and trusted now (not being released)."""
        return {p for p in self.held if self.holds(p)}

    def _value(self, owner: str, sent_wall: float) -> bytes:
        return orjson.dumps({"owner": owner, "expires": sent_wall + self.lease_s})

    async def _write(self, partition: int, revision: int, owner: str) -> int | None:
        """CAS-write ``partition``'s lease for ``owner``; the new revision, or None if the
        key changed meanwhile."""
        kv = await self._bucket()
        try:
            return int(await kv.update(partition_key(partition),
                                       self._value(owner, self.wall()), last=revision))
        except KeyWrongLastSequenceError:
            return None

    async def _read_all(self) -> tuple[dict[int, tuple[int, str, float]], int]:
        """Every partition's ``(revision, owner, expires)`` (absent: revision 0) and the
        number of live fetchers (heartbeats not expired, this one included)."""
        kv = await self._bucket()
        now = self.wall()

        async def one(partition: int) -> tuple[int, str, float]:
            try:
                entry = await kv.get(partition_key(partition))
            except KeyNotFoundError:
                return 0, "", 0.0
            try:
                raw = orjson.loads(entry.value or b"{}")
            except orjson.JSONDecodeError:
                raw = {}
            return int(entry.revision or 0), str(raw.get("owner", "")), float(raw.get("expires", 0))

        rows = await asyncio.gather(*(one(p) for p in range(self.partitions)))
        live = 1
        beats = [k for k in await self._heartbeat_keys() if k != heartbeat_key(self.owner)]

        async def alive(key: str) -> bool:
            try:
                entry = await kv.get(key)
                return float(orjson.loads(entry.value or b"{}").get("expires", 0)) > now
            except (KeyNotFoundError, orjson.JSONDecodeError):
                return False

        live += sum(await asyncio.gather(*(alive(k) for k in beats)))
        return dict(enumerate(rows)), live

    async def _heartbeat_keys(self) -> list[str]:
        """Keys ``fetcher.<id>`` present, from the bucket stream's subject list (one API
        call). Not ``kv.keys()``: nats-py lists keys through a watcher that can come back
        empty under load (and its filters match substrings), which would make a fetcher
        believe it is alone and claim every partition. An error propagates (the tick fails
        and nothing is claimed)."""
        prefix = f"$KV.{LEASES_BUCKET}."
        info = await self.js.stream_info(f"KV_{LEASES_BUCKET}",
                                         subjects_filter=f"{prefix}fetcher.>")
        return [subject.removeprefix(prefix) for subject in (info.state.subjects or {})]

    async def tick(self) -> tuple[set[int], set[int]]:
        """Renew, rebalance and claim (see module docstring).

        Returns ``(acquired, to_release)``: partitions newly held, and partitions this
        fetcher should stop serving and then :meth:`release` (no longer trusted already).
        Partitions lost (renewal refused) are dropped from :attr:`held` and returned in
        ``to_release`` too (their release is a no-op).
        """
        kv = await self._bucket()
        sent = self.clock()
        await kv.put(heartbeat_key(self.owner),
                     orjson.dumps({"expires": self.wall() + self.lease_s}))
        rows, self.live = await self._read_all()
        to_release: set[int] = set()
        # renew what we hold
        for partition, held in list(self.held.items()):
            revision, owner, _ = rows[partition]
            if self.held.get(partition) is not held:
                continue  # released meanwhile (a drained loop's release() ran during an await)
            if owner != self.owner or revision != held.revision:
                log.warning("lost partition %d to %r", partition, owner or "nobody")
                self.held.pop(partition, None)
                to_release.add(partition)
                continue
            sent = self.clock()  # a partition being released is renewed until it is drained
            new = await self._write(partition, revision, self.owner)
            if new is None:
                self.held.pop(partition, None)
                to_release.add(partition)
                continue
            held.revision, held.valid_until = new, sent + self.lease_s - self.guard_s
            rows[partition] = (new, self.owner, self.wall() + self.lease_s)
        share = math.ceil(self.partitions / max(self.live, 1))
        active = sorted(p for p, h in self.held.items() if not h.releasing)
        for partition in active[share:]:  # above our share: give the highest ones back
            if (held := self.held.get(partition)) is not None:
                held.releasing = True
                to_release.add(partition)
        acquired: set[int] = set()
        wanted = share - min(len(active), share)
        now = self.wall()
        order = [(self._start + i) % self.partitions for i in range(self.partitions)]
        for partition in order:
            if wanted <= 0:
                break
            if partition in self.held:
                continue
            revision, owner, expires = rows[partition]
            if owner and expires + self.grace_s > now:
                continue
            sent = self.clock()
            new = await self._write(partition, revision, self.owner)
            if new is None:
                continue
            self.held[partition] = _Held(new, sent + self.lease_s - self.guard_s)
            acquired.add(partition)
            wanted -= 1
        return acquired, to_release

    async def release(self, partition: int) -> None:
        """Give ``partition`` back (free for others at once), if still ours."""
        held = self.held.pop(partition, None)
        if held is None:
            return
        kv = await self._bucket()
        with contextlib.suppress(KeyWrongLastSequenceError):
            await kv.update(partition_key(partition),
                            orjson.dumps({"owner": "", "expires": 0}), last=held.revision)

    async def leave(self) -> None:
        """Release every partition and delete the heartbeat (a clean stop)."""
        for partition in list(self.held):
            with contextlib.suppress(Exception):
                await self.release(partition)
        kv = await self._bucket()
        with contextlib.suppress(Exception):
            await kv.delete(heartbeat_key(self.owner))
