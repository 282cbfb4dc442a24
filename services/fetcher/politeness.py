"""Per-host politeness: a budget per host, shared by every tenant and job, and kept in KV.

The politeness key is ``host[:port]``. Its rule (:meth:`HostPoliteness.rule_for`, data:
:class:`~services.fetcher.settings.HostRule`): request *starts* at least ``delay_s``
apart, at most ``max_in_flight`` requests in flight, and, with one in flight, the host
also rests ``delay_s`` after each request *ended* (idle for the whole delay). ``delay_s``
is the first matching ``host_rules`` pattern's, else ``host_delays``', else
``default_delay_s`` (:func:`fnmatch.fnmatchcase` on ``host`` or ``host:port``), raised to
robots.txt's ``Crawl-delay``; a Crawl-delay above the ceiling is honoured too, but the
rule says ``defer`` (its entries are always re-published for their due time, never held).
The delay is then multiplied by the host's adaptive slow-down factor (see
:class:`~services.fetcher.settings.FetcherSettings`). A ``Retry-After`` pauses the host
(:meth:`HostPoliteness.pause`).

Requests to a host take turns round-robin among tenants, FIFO within a tenant
(:class:`FairGate`, :meth:`HostPoliteness.turn`): a tenant with thousands of URLs queued for a
host takes turns with a tenant that has a few, and the host's one budget is shared by
both. While waiting, and
right before the request starts, the turn calls its ``guard`` (the partition lease check
of :mod:`services.fetcher.leases`), which raises :class:`LeaseLost` once this fetcher no
longer owns the host's partition: the entry is then re-published, not fetched.

The state lives in this process (its owner is the only fetcher serving the host) and is
mirrored in the ``hosts`` KV bucket (:mod:`services.fetcher.hoststate`): written when a
request starts (its next-due time), when it ends and when the host is paused; read the
first time the host is served after :meth:`HostPoliteness.forget` (called when this
fetcher takes a partition), so a new owner honours the previous owner's budget.

The queue can be estimated (:meth:`HostPoliteness.queue_wait_s`) so the handler can
re-publish an entry that would wait beyond its horizon instead of holding it; entries
re-published for later are *booked* (:meth:`HostPoliteness.book`), per tenant, so the
next ones are spread after them rather than all given the same due time, and so one tenant's
bookings far into the future do not push another tenant's first URL behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from services.fetcher.hoststate import HostRecord, HostStore

if TYPE_CHECKING:
    from services.fetcher.settings import FetcherSettings, HostRule

log = logging.getLogger(__name__)

MAX_IDLE_HOSTS = 10_000
"""Idle host records kept before the oldest are forgotten."""

CHECK_S = 0.2
"""Longest sleep between two lease checks while a request waits for its turn."""


class Turn:
    """A host's turn, given to the request made in it: call :meth:`sent` when the request's
    headers go out (the downloader does, from httpx's trace hook). Until then the host's
    next turn is not given, and the next request is spaced ``delay_s`` from that moment."""

    def __init__(self) -> None:
        self.sent_at: float | None = None
        self.mark_sent: Callable[[], None] = lambda: None

    def sent(self) -> None:
        self.mark_sent()


class LeaseLost(Exception):
    """This fetcher no longer owns the partition of the host it was about to request."""


Guard = Callable[[], None]
"""Raises :class:`LeaseLost` if the request must not be made."""


@dataclass(frozen=True)
class Rule:
    """The rule in force for a host right now."""

    delay_s: float
    max_in_flight: int = 1
    defer: bool = False
    """Crawl-delay above the ceiling: re-publish the host's entries, never hold them."""


@dataclass(frozen=True)
class Adaptive:
    """The adaptive slow-down rule (stated in :class:`FetcherSettings`)."""

    slow_s: float = 2.0
    max_factor: float = 8.0
    recovery: float = 0.8
    floor_s: float = 0.25


class FairGate:
    """A lock handed out round-robin among keys (tenants), first come first served within a
    key: when it is released, the next holder is the oldest waiter of the key after the
    last holder's in rotation, so no key waits behind another key's whole queue.

    Waiters that are cancelled leave their queue; a waiter cancelled just after being
    handed the lock passes it on.
    """

    def __init__(self) -> None:
        self._held = False
        self._holder = ""  # key of the current (or last) holder
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}  # key order = rotation

    def locked(self) -> bool:
        return self._held

    async def acquire(self, key: str) -> None:
        if not self._held and not self._waiters:
            self._held, self._holder = True, key
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed the lock, then cancelled: pass it on
            else:
                queue = self._waiters.get(key)
                if queue is not None:
                    with contextlib.suppress(ValueError):
                        queue.remove(waiter)
                    if not queue:
                        del self._waiters[key]
            raise

    def release(self) -> None:
        """Hand the lock to the next key's oldest waiter, or free it."""
        while self._waiters:
            # the first key in rotation other than the one that just had its turn
            key = next((k for k in self._waiters if k != self._holder), self._holder)
            queue = self._waiters.pop(key)
            waiter = queue.popleft()
            if queue:
                self._waiters[key] = queue  # to the back of the rotation
            if not waiter.done():
                self._holder = key
                waiter.set_result(None)  # the lock passes on, still held
                return
        self._held = False


@dataclass
class _Host:
    gate: FairGate = field(default_factory=FairGate)  # who starts next
    freed: asyncio.Event = field(default_factory=asyncio.Event)
    ready_at: float = 0.0  # monotonic time before which no request may start
    paused_until: float = 0.0  # monotonic
    booked: dict[str, float] = field(default_factory=dict)  # tenant -> end of its last booking
    by_tenant: Counter[str] = field(default_factory=Counter)  # requests waiting or in flight
    queued: int = 0  # requests waiting or in flight
    in_flight: int = 0
    last_delay_s: float = 0.0
    factor: float = 1.0
    loaded: bool = False  # read from the store since the last forget()
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one store write at a time


class HostPoliteness:
    """The per-host budgets served by one fetcher process (see module docstring).

    Args:
        default_delay_s: least gap between two request starts to a host, seconds.
        host_delays: glob pattern -> delay in seconds, tried in order.
        crawl_delay_max_s: Crawl-delay ceiling, seconds (above it the host is deferred).
        clock: monotonic seconds (tests may pass their own).
        host_rules: glob pattern -> :class:`HostRule`, tried first, in order.
        default_max_in_flight: requests in flight per host unless a rule says otherwise.
        adaptive: the slow-down rule (None: no slow-down).
        store: where the state is shared with other fetchers (None: this process only).
        wall: wall-clock seconds since the epoch (times in the store).
    """

    def __init__(self, default_delay_s: float, host_delays: Mapping[str, float],
                 crawl_delay_max_s: float, clock: Callable[[], float] = time.monotonic, *,
                 host_rules: Mapping[str, HostRule] | None = None,
                 default_max_in_flight: int = 1, adaptive: Adaptive | None = None,
                 store: HostStore | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.default_delay_s = default_delay_s
        self.host_delays = dict(host_delays)
        self.crawl_delay_max_s = crawl_delay_max_s
        self.clock = clock
        self.host_rules = dict(host_rules or {})
        self.default_max_in_flight = default_max_in_flight
        self.adaptive = adaptive
        self.store = store
        self.wall = wall
        self._hosts: dict[str, _Host] = {}
        self._writes: set[asyncio.Task[None]] = set()

    @classmethod
    def from_settings(cls, settings: FetcherSettings, store: HostStore | None = None) -> HostPoliteness:
        return cls(
            settings.default_delay_s, settings.host_delays, settings.crawl_delay_max_s,
            host_rules=settings.host_rules, default_max_in_flight=settings.default_max_in_flight,
            adaptive=Adaptive(settings.adaptive_slow_s, settings.adaptive_max_factor,
                              settings.adaptive_recovery, settings.adaptive_floor_s),
            store=store,
        )

    # ---- rules ---------------------------------------------------------------------------

    def rule_for(self, host: str, crawl_delay_s: float | None = None) -> Rule:
        """The rule in force for ``host`` (``host`` or ``host:port``)."""
        host = host.lower()
        bare = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        delay, in_flight, ceiling = None, None, self.crawl_delay_max_s
        for pattern, rule in self.host_rules.items():
            if fnmatchcase(host, pattern) or fnmatchcase(bare, pattern):
                delay, in_flight = rule.delay_s, rule.max_in_flight
                ceiling = ceiling if rule.crawl_delay_max_s is None else rule.crawl_delay_max_s
                break
        if delay is None:
            delay = self.default_delay_s
            for pattern, override in self.host_delays.items():
                if fnmatchcase(host, pattern) or fnmatchcase(bare, pattern):
                    delay = override
                    break
        defer = False
        if crawl_delay_s:
            delay = max(delay, crawl_delay_s)
            defer = crawl_delay_s > ceiling
        state = self._hosts.get(host)
        if state is not None and state.factor > 1.0 and self.adaptive is not None:
            delay = max(delay, self.adaptive.floor_s) * state.factor
        return Rule(delay, in_flight or self.default_max_in_flight, defer)

    def delay_for(self, host: str, crawl_delay_s: float | None = None) -> float:
        """Seconds to leave between two request starts to ``host``."""
        return self.rule_for(host, crawl_delay_s).delay_s

    # ---- queue estimates and bookings ----------------------------------------------------

    def queue_wait_s(self, host: str, delay_s: float, tenant: str = "") -> float:
        """Estimated seconds before a request of ``tenant`` joining ``host``'s queue now
        would start.

        Turns go round-robin among tenants (:class:`FairGate`): with ``m`` requests of its
        own ahead, a request waits for ``m`` plus, of each other tenant, at most ``m + 1``.
        Each is assumed to take no time beyond its delay (a lower bound).
        """
        state = self._hosts.get(host.lower())
        if state is None:
            return 0.0
        idle_in = max(state.ready_at - self.clock(), 0.0)
        mine = state.by_tenant.get(tenant, 0)
        ahead = mine + sum(min(count, mine + 1) for other, count in state.by_tenant.items()
                           if other != tenant)
        return idle_in + ahead * max(delay_s, state.last_delay_s)

    def booked_wait_s(self, host: str, tenant: str = "") -> float:
        """Seconds until the slots ``tenant`` already booked for re-published entries of
        ``host`` end."""
        state = self._hosts.get(host.lower())
        if state is None:
            return 0.0
        return max(state.booked.get(tenant, 0.0) - self.clock(), 0.0)

    def book(self, host: str, wait_s: float, delay_s: float, tenant: str = "") -> None:
        """Record that an entry of ``tenant`` for ``host`` was re-published to start in
        ``wait_s`` seconds. Its slot is ``delay_s`` times the number of tenants with work
        or bookings on the host (they share it turn by turn)."""
        state = self._state(host)
        now = self.clock()
        sharing = {t for t, until in state.booked.items() if until > now}
        sharing |= {t for t, count in state.by_tenant.items() if count}
        sharing.add(tenant)
        state.booked = {t: until for t, until in state.booked.items() if until > now}
        state.booked[tenant] = max(state.booked.get(tenant, 0.0),
                                   now + wait_s + delay_s * len(sharing))

    # ---- feedback --------------------------------------------------------------------------

    def pause(self, host: str, seconds: float) -> None:
        """Start no request to ``host`` for ``seconds`` (e.g. a ``Retry-After``)."""
        state = self._state(host)
        until = self.clock() + seconds
        state.ready_at = max(state.ready_at, until)
        state.paused_until = max(state.paused_until, until)
        self._save_soon(host, state)

    def penalise(self, host: str) -> None:
        """A request to ``host`` failed (e.g. 429 or 5xx): slow the host down."""
        state = self._state(host)
        self._adapt(state, failed=True, elapsed_s=0.0)
        self._save_soon(host, state)

    def _adapt(self, state: _Host, *, failed: bool, elapsed_s: float) -> None:
        rule = self.adaptive
        if rule is None:
            return
        if failed or elapsed_s > rule.slow_s:
            state.factor = min(max(state.factor, 1.0) * 2.0, rule.max_factor)
        else:
            state.factor = max(1.0, state.factor * rule.recovery)

    # ---- shared state ----------------------------------------------------------------------

    def forget(self, belongs: Callable[[str], bool]) -> None:
        """Drop what this process knows of the hosts ``belongs`` selects (a partition just
        taken): their state is read from the store again before their next request."""
        for host, state in list(self._hosts.items()):
            if belongs(host):
                if state.queued == 0:
                    del self._hosts[host]
                else:
                    state.loaded = False

    async def _load(self, host: str, state: _Host) -> None:
        if state.loaded or self.store is None:
            return
        try:
            record = await self.store.get(host)
        except Exception as error:  # no store: our own state is all we have
            log.warning("cannot read the politeness state of %s: %r", host, error)
            return
        state.loaded = True
        if record is None:
            return
        offset = self.clock() - self.wall()
        state.ready_at = max(state.ready_at, record.next_due + offset)
        state.paused_until = max(state.paused_until, record.paused_until + offset)
        state.factor = max(state.factor, record.factor)

    def _record(self, state: _Host) -> HostRecord:
        offset = self.wall() - self.clock()
        return HostRecord(next_due=state.ready_at + offset,
                          paused_until=state.paused_until + offset if state.paused_until else 0.0,
                          factor=state.factor)

    async def _save(self, host: str, state: _Host) -> None:
        """Write ``host``'s state. Writes of one host are serialised and each takes the
        state as it is when its turn comes, so a late write never puts back an older
        next-due time."""
        if self.store is None:
            return
        async with state.writing:
            try:
                await self.store.put(host, self._record(state))
            except Exception as error:
                log.warning("cannot write the politeness state of %s: %r", host, error)

    def _save_soon(self, host: str, state: _Host) -> None:
        if self.store is None:
            return
        task = asyncio.get_running_loop().create_task(self._save(host, state))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def flush(self) -> None:
        """Wait for the state writes still under way."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    # ---- turns -------------------------------------------------------------------------------

    @asynccontextmanager
    async def turn(self, host: str, delay_s: float, guard: Guard | None = None,
                   max_in_flight: int | None = None, tenant: str = "") -> AsyncIterator[Turn]:
        """Wait for ``host``'s turn; the body is the request.

        The request starts at least ``delay_s`` after the previous start (and, with one in
        flight, after the previous end), with fewer than ``max_in_flight`` (default: the
        host's rule) in flight. Turns go round-robin among ``tenant`` s. ``guard`` is called
        while waiting and right before the start; its :class:`LeaseLost` propagates (no
        request made).
        """
        host = host.lower()
        limit = max_in_flight or self.rule_for(host).max_in_flight
        state = self._state(host)
        state.queued += 1
        state.by_tenant[tenant] += 1
        try:
            await state.gate.acquire(tenant)
            try:
                while True:
                    if guard is not None:
                        guard()
                    await self._load(host, state)
                    if state.in_flight >= limit:
                        state.freed.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(state.freed.wait(), CHECK_S)
                        continue
                    if (wait := state.ready_at - self.clock()) > 0:
                        await asyncio.sleep(min(wait, CHECK_S))
                        continue
                    if guard is not None:
                        guard()  # right before the request
                    break
            except BaseException:
                state.gate.release()
                raise
            started = self.clock()
            state.in_flight += 1
            state.ready_at = max(state.ready_at, started + delay_s)
            failed = False
            turn = Turn()
            try:
                try:
                    await self._save(host, state)  # a new owner sees this start
                    if guard is not None:
                        guard()  # the write took time: check again
                except BaseException:
                    state.gate.release()
                    raise

                def sent() -> None:
                    # The request's headers are going out now: the next request of this
                    # host is spaced from here, and may not even be admitted before (a
                    # request that needed a new connection must not be overtaken by one
                    # on a pooled connection, or the host would see them closer than the
                    # delay).
                    nonlocal started
                    if turn.sent_at is None:
                        started = turn.sent_at = self.clock()
                        state.ready_at = max(state.ready_at, started + delay_s)
                        state.gate.release()

                turn.mark_sent = sent
                try:
                    yield turn
                finally:
                    sent()  # failed before sending, or the caller did not report it
            except BaseException:
                failed = True
                raise
            finally:
                ended = self.clock()
                state.in_flight -= 1
                state.freed.set()
                state.last_delay_s = delay_s
                if limit == 1:
                    state.ready_at = max(state.ready_at, ended + delay_s)
                self._adapt(state, failed=failed, elapsed_s=ended - started)
                self._save_soon(host, state)
        finally:
            state.queued -= 1
            state.by_tenant[tenant] -= 1
            if not state.by_tenant[tenant]:
                del state.by_tenant[tenant]
            self._forget_idle()

    def _state(self, host: str) -> _Host:
        host = host.lower()
        state = self._hosts.get(host)
        if state is None:
            state = self._hosts[host] = _Host()
        return state

    def _forget_idle(self) -> None:
        if len(self._hosts) <= MAX_IDLE_HOSTS:
            return
        now = self.clock()
        for host, state in list(self._hosts.items()):
            if state.queued == 0 and state.ready_at <= now and \
                    all(until <= now for until in state.booked.values()):
                del self._hosts[host]
