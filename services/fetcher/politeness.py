"""Per-host politeness: one request at a time per host, and a pause between requests.

A host (the politeness key: ``host[:port]``) has a FIFO queue: a request waits for its
turn, then at least its host's delay after the previous request *ended* (the host is idle
for the whole delay). The delay is ``default_delay_s`` unless a ``host_delays`` glob
(:func:`fnmatch.fnmatchcase` on ``host`` or ``host:port``; the first matching pattern
wins) says otherwise, and never less than robots.txt's ``Crawl-delay`` capped at
``crawl_delay_max_s``. A ``Retry-After`` pauses the host (:meth:`HostPoliteness.pause`).

The queue can be estimated (:meth:`HostPoliteness.queue_wait_s`) so the handler can
re-publish an entry that would wait beyond its horizon instead of holding it; entries
re-published for later are *booked* (:meth:`HostPoliteness.book`) so the next ones are
spread after them rather than all given the same due time.

This state is per process: the frontier partition owner is the one fetcher serving a
host (DESIGN.md "Frontier and politeness"); moving next-due times to KV comes with leases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

MAX_IDLE_HOSTS = 10_000
"""Idle host records kept before the oldest are forgotten."""


@dataclass
class _Host:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ready_at: float = 0.0  # monotonic time before which no request may start
    booked_until: float = 0.0  # end of the last slot booked for a re-published entry
    queued: int = 0  # requests waiting or in flight
    last_delay_s: float = 0.0


class HostPoliteness:
    """The per-host queues and delays of one fetcher process (see module docstring).

    Args:
        default_delay_s: pause between two requests to a host, seconds.
        host_delays: glob pattern -> delay in seconds, tried in order.
        crawl_delay_max_s: ceiling on a robots.txt Crawl-delay, seconds.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, default_delay_s: float, host_delays: Mapping[str, float],
                 crawl_delay_max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.default_delay_s = default_delay_s
        self.host_delays = dict(host_delays)
        self.crawl_delay_max_s = crawl_delay_max_s
        self.clock = clock
        self._hosts: dict[str, _Host] = {}

    def delay_for(self, host: str, crawl_delay_s: float | None = None) -> float:
        """Seconds to leave between two requests to ``host`` (``host`` or ``host:port``)."""
        host = host.lower()
        bare = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        delay = self.default_delay_s
        for pattern, override in self.host_delays.items():
            if fnmatchcase(host, pattern) or fnmatchcase(bare, pattern):
                delay = override
                break
        if crawl_delay_s:
            delay = max(delay, min(crawl_delay_s, self.crawl_delay_max_s))
        return delay

    def queue_wait_s(self, host: str, delay_s: float) -> float:
        """Estimated seconds before a request joining ``host``'s queue now would start.

        Each request ahead is assumed to take no time beyond its delay (a lower bound).
        """
        state = self._hosts.get(host)
        if state is None:
            return 0.0
        idle_in = max(state.ready_at - self.clock(), 0.0)
        return idle_in + state.queued * max(delay_s, state.last_delay_s)

    def booked_wait_s(self, host: str) -> float:
        """Seconds until the slots already booked for re-published entries of ``host`` end."""
        state = self._hosts.get(host)
        return 0.0 if state is None else max(state.booked_until - self.clock(), 0.0)

    def book(self, host: str, wait_s: float, delay_s: float) -> None:
        """Record that an entry of ``host`` was re-published to start in ``wait_s`` seconds."""
        state = self._state(host)
        state.booked_until = max(state.booked_until, self.clock() + wait_s + delay_s)

    def pause(self, host: str, seconds: float) -> None:
        """Start no request to ``host`` for ``seconds`` (e.g. a ``Retry-After``)."""
        state = self._state(host)
        state.ready_at = max(state.ready_at, self.clock() + seconds)

    @asynccontextmanager
    async def turn(self, host: str, delay_s: float) -> AsyncIterator[None]:
        """Wait for ``host``'s turn; the body is the request. Afterwards the host rests
        ``delay_s`` seconds before the next request starts."""
        state = self._state(host)
        state.queued += 1
        try:
            async with state.lock:
                # ready_at may move while we sleep (pause()): sleep to its latest value.
                while (wait := state.ready_at - self.clock()) > 0:  # noqa: ASYNC110
                    await asyncio.sleep(wait)
                try:
                    yield
                finally:
                    state.last_delay_s = delay_s
                    state.ready_at = max(state.ready_at, self.clock() + delay_s)
        finally:
            state.queued -= 1
            self._forget_idle()

    def _state(self, host: str) -> _Host:
        state = self._hosts.get(host)
        if state is None:
            state = self._hosts[host] = _Host()
        return state

    def _forget_idle(self) -> None:
        if len(self._hosts) <= MAX_IDLE_HOSTS:
            return
        now = self.clock()
        for host, state in list(self._hosts.items()):
            if state.queued == 0 and state.ready_at <= now and state.booked_until <= now:
                del self._hosts[host]
