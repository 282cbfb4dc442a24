"""Politeness: one request at a time per host, delays between requests, re-publishing
entries whose turn is beyond the horizon (never holding them, never nak'ing them)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import pytest

from services.fetcher.handler import FRONTIER_ID_STAGE
from services.fetcher.politeness import FairGate, HostPoliteness, Rule
from shared import subjects
from shared.contracts import FetchedPage, FrontierEntry, utc_now
from tests.sites import Site
from tests.unit.fetcher.conftest import JOB, TENANT, MakeHandler, Stamps, delivery, entry, respond


def test_delay_for_default_globs_and_crawl_delay() -> None:
    polite = HostPoliteness(1.0, {"127.0.0.*": 0.0, "*.example.com:8080": 3.0, "*.example.com": 2.0},
                            crawl_delay_max_s=10.0)
    assert polite.delay_for("other.org") == 1.0
    assert polite.delay_for("127.0.0.1:5000") == 0.0  # matched on the bare host
    assert polite.delay_for("www.example.com:8080") == 3.0  # first matching pattern wins
    assert polite.delay_for("www.example.com") == 2.0
    assert polite.delay_for("127.0.0.1:5000", crawl_delay_s=4.0) == 4.0
    # above the ceiling: still honoured, but the host is deferred (never held, never hammered)
    assert polite.rule_for("other.org", crawl_delay_s=60.0) == Rule(60.0, 1, defer=True)
    assert polite.rule_for("other.org", crawl_delay_s=9.0) == Rule(9.0, 1, defer=False)
    assert polite.delay_for("www.example.com", crawl_delay_s=0.5) == 2.0  # never below ours


async def test_default_delay_spaces_requests_and_override_removes_it(
    site: Site, make_handler: MakeHandler
) -> None:
    stamps = Stamps()
    site.routes.update({"/a": stamps, "/b": stamps, "/c": stamps})
    slow = make_handler(default_delay_s=0.3)
    await asyncio.gather(*(slow.handle(entry(site.url(p)), delivery()) for p in ("/a", "/b", "/c")))
    assert len(stamps.times) == 3 and min(stamps.gaps()) >= 0.28

    stamps.times.clear()
    fast = make_handler(default_delay_s=5.0, host_delays={"127.0.0.*": 0})
    started = time.monotonic()
    await asyncio.gather(*(fast.handle(entry(site.url(p)), delivery()) for p in ("/a", "/b", "/c")))
    assert len(stamps.times) == 3 and time.monotonic() - started < 1.0


async def test_one_request_in_flight_per_host(site: Site, make_handler: MakeHandler) -> None:
    lock = threading.Lock()
    state = {"now": 0, "most": 0}

    def slow(req: BaseHTTPRequestHandler) -> None:
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.1)
        with lock:
            state["now"] -= 1
        respond(req, 200, b"<html>slow</html>")

    paths = [f"/s{n}" for n in range(4)]
    site.routes.update(dict.fromkeys(paths, slow))
    handler = make_handler()
    outputs = await asyncio.gather(*(handler.handle(entry(site.url(p)), delivery()) for p in paths))
    assert all(out[0].message.status == 200 for out in outputs)
    assert state["most"] == 1


async def test_entry_beyond_the_horizon_is_republished_for_later(
    site: Site, make_handler: MakeHandler
) -> None:
    site.pages = {"/a": (200, "text/html", b"<html>a</html>")}
    handler = make_handler(default_delay_s=0.5, queue_horizon_s=2.0)
    first = entry(site.url("/a"))
    handler.politeness.pause(first.host, 5.0)  # e.g. a Retry-After: the host is busy for 5 s
    before = utc_now()
    (out,) = await handler.handle(first, delivery())
    later = out.message
    assert isinstance(later, FrontierEntry)
    assert out.subject == subjects.frontier(subjects.partition_of(first.host), TENANT, JOB)
    assert out.msg_id == subjects.msg_id(FRONTIER_ID_STAGE, TENANT, JOB, first.fingerprint, 1)
    assert later.generation == 1 and later.url == first.url
    assert later.not_before is not None
    assert timedelta(seconds=4.5) < later.not_before - before < timedelta(seconds=6)
    assert site.requests == ["/robots.txt"]  # the page itself was not requested

    second = entry(site.url("/b"))  # booked after the first one, not on top of it
    (out2,) = await handler.handle(second, delivery())
    assert out2.message.not_before - later.not_before >= timedelta(seconds=0.45)


async def test_entry_due_within_the_horizon_waits(site: Site, make_handler: MakeHandler) -> None:
    stamps = Stamps()
    site.routes["/a"] = stamps
    handler = make_handler(queue_horizon_s=2.0)
    due = utc_now() + timedelta(seconds=0.4)
    started = time.monotonic()
    (out,) = await handler.handle(entry(site.url("/a"), generation=1, not_before=due), delivery())
    assert isinstance(out.message, FetchedPage) and out.message.status == 200
    assert stamps.times[0] - started >= 0.38
    assert out.msg_id == subjects.msg_id("fetcher", TENANT, JOB, out.message.fingerprint, 1)


async def test_far_future_entry_is_held_briefly_then_republished(
    site: Site, make_handler: MakeHandler
) -> None:
    handler = make_handler(queue_horizon_s=1.0, reschedule_hold_s=0.2)
    due = utc_now() + timedelta(seconds=30)
    started = time.monotonic()
    (out,) = await handler.handle(entry(site.url("/a"), generation=3, not_before=due), delivery())
    assert 0.18 <= time.monotonic() - started < 1.0  # held, so it does not circulate hot
    assert isinstance(out.message, FrontierEntry)
    assert out.message.generation == 4 and out.message.not_before == due
    assert "/a" not in site.requests


async def test_far_future_entry_that_becomes_due_while_held_is_fetched(
    site: Site, make_handler: MakeHandler
) -> None:
    site.pages = {"/a": (200, "text/html", b"<html>a</html>")}
    handler = make_handler(queue_horizon_s=0.3, reschedule_hold_s=1.0)
    due = utc_now() + timedelta(seconds=0.6)
    (out,) = await handler.handle(entry(site.url("/a"), generation=1, not_before=due), delivery())
    assert isinstance(out.message, FetchedPage) and out.message.status == 200


async def test_turn_is_fifo_and_pause_delays_it() -> None:
    polite = HostPoliteness(0.0, {}, 10.0)
    order: list[int] = []

    async def take(n: int) -> None:
        async with polite.turn("h", 0.05):
            order.append(n)

    polite.pause("h", 0.2)
    assert polite.queue_wait_s("h", 0.05) > 0.15
    started = time.monotonic()
    await asyncio.gather(*(take(n) for n in range(4)))
    assert order == [0, 1, 2, 3]
    assert time.monotonic() - started >= 0.2 + 3 * 0.05 - 0.02


# ---- shared budgets (issue 5) ---------------------------------------------------------------


async def test_starts_spaced_with_several_in_flight() -> None:
    from services.fetcher.settings import HostRule

    polite = HostPoliteness(0.0, {}, 10.0, host_rules={"h": HostRule(delay_s=0.05, max_in_flight=2)})
    starts: list[float] = []
    now = {"in": 0, "most": 0}

    async def take() -> None:
        async with polite.turn("h", polite.delay_for("h")) as turn:
            turn.sent()  # what the downloader does when the request headers go out
            starts.append(time.monotonic())
            now["in"] += 1
            now["most"] = max(now["most"], now["in"])
            await asyncio.sleep(0.2)
            now["in"] -= 1

    await asyncio.gather(*(take() for _ in range(5)))
    assert now["most"] == 2
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 0.045


async def test_next_turn_waits_until_the_request_is_sent() -> None:
    """A request slow to go out (a new connection) is not overtaken: the host's next turn
    is given only once it is sent, and spaced from that moment."""
    from services.fetcher.settings import HostRule

    polite = HostPoliteness(0.0, {}, 10.0, host_rules={"h": HostRule(delay_s=0.05, max_in_flight=2)})
    sent: list[float] = []

    async def take(connect_s: float) -> None:
        async with polite.turn("h", polite.delay_for("h")) as turn:
            await asyncio.sleep(connect_s)  # connection set-up before the headers go out
            turn.sent()
            sent.append(time.monotonic())
            await asyncio.sleep(0.1)

    await asyncio.gather(take(0.3), take(0.0), take(0.0))
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert min(gaps) >= 0.045, gaps


async def test_a_new_owner_honours_the_stored_next_due_time_and_pause() -> None:
    from services.fetcher.hoststate import MemoryHostStore

    store = MemoryHostStore()
    old = HostPoliteness(0.0, {}, 10.0, store=store)
    old.pause("h", 0.4)  # e.g. a Retry-After seen by the old owner
    await old.flush()
    new = HostPoliteness(0.0, {}, 10.0, store=store)
    started = time.monotonic()
    async with new.turn("h", 0.0):
        assert time.monotonic() - started >= 0.35


async def test_lease_lost_while_waiting_means_no_request() -> None:
    from services.fetcher.politeness import LeaseLost

    polite = HostPoliteness(0.0, {}, 10.0)
    polite.pause("h", 0.5)
    lost = {"now": False}

    def guard() -> None:
        if lost["now"]:
            raise LeaseLost("h")

    async def lose_soon() -> None:
        await asyncio.sleep(0.1)
        lost["now"] = True

    requested = []
    task = asyncio.create_task(lose_soon())
    with pytest.raises(LeaseLost):
        async with polite.turn("h", 0.0, guard):
            requested.append(1)
    await task
    assert requested == []
    async with polite.turn("h", 0.0):  # the in-flight count did not leak
        pass


def test_adaptive_slow_down_doubles_then_recovers() -> None:
    from services.fetcher.politeness import Adaptive

    polite = HostPoliteness(0.1, {}, 10.0, adaptive=Adaptive(slow_s=1.0, max_factor=8.0,
                                                             recovery=0.5, floor_s=0.25))
    polite.penalise("h")
    assert polite.delay_for("h") == pytest.approx(0.5)  # max(0.1, floor 0.25) x 2
    for _ in range(3):
        polite.penalise("h")
    assert polite.delay_for("h") == pytest.approx(0.25 * 8)  # capped at 8x


# ---- tenants take turns on a shared host ---------------------------------------------------


async def test_fair_gate_hands_turns_round_robin_among_tenants() -> None:
    gate = FairGate()
    order: list[str] = []

    async def take(tenant: str, n: int) -> None:
        await gate.acquire(tenant)
        order.append(f"{tenant}{n}")
        await asyncio.sleep(0)
        gate.release()

    await gate.acquire("a")  # held while everybody queues
    tasks = [asyncio.create_task(take("a", n)) for n in range(5)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(take("b", n)) for n in range(2)]
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(*tasks)
    assert order == ["b0", "a0", "b1", "a1", "a2", "a3", "a4"]  # "a" just had its turn
    assert not gate.locked()


async def test_fair_gate_survives_cancelled_waiters() -> None:
    gate = FairGate()
    await gate.acquire("a")
    gone = asyncio.create_task(gate.acquire("b"))
    stays = asyncio.create_task(gate.acquire("c"))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    gate.release()
    await asyncio.wait_for(stays, 1)  # the cancelled waiter was skipped
    # handed the lock and cancelled before it ran: the lock passes on, not lost
    handed = asyncio.create_task(gate.acquire("b"))
    after = asyncio.create_task(gate.acquire("d"))
    await asyncio.sleep(0)
    gate.release()  # hands it to `handed`...
    handed.cancel()  # ...which is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await handed
    await asyncio.wait_for(after, 1)
    assert gate.locked()
    gate.release()
    assert not gate.locked()


async def test_a_small_tenant_is_not_queued_behind_a_large_one_on_the_same_host() -> None:
    polite = HostPoliteness(0.0, {}, 10.0)
    order: list[str] = []

    async def take(tenant: str) -> None:
        async with polite.turn("h", 0.01, tenant=tenant):
            order.append(tenant)

    tasks = [asyncio.create_task(take("big")) for _ in range(20)]
    await asyncio.sleep(0)
    # the small tenant's estimate counts one turn of the big tenant's, not its whole queue
    assert polite.queue_wait_s("h", 0.01, "small") < 0.01 * 3
    assert polite.queue_wait_s("h", 0.01, "big") >= 0.01 * 19
    tasks += [asyncio.create_task(take("small")) for _ in range(2)]
    await asyncio.gather(*tasks)
    assert order.index("small") <= 2 and order.index("small", order.index("small") + 1) <= 4
    assert order.count("big") == 20


def test_bookings_are_per_tenant_and_shared_slots_are_spread() -> None:
    now = [100.0]
    polite = HostPoliteness(0.0, {}, 10.0, clock=lambda: now[0])
    polite.book("h", 300.0, 0.02, tenant="big")  # the big tenant's backlog, far ahead
    assert polite.booked_wait_s("h", "big") == pytest.approx(300.02)
    assert polite.booked_wait_s("h", "small") == 0.0  # not behind the big tenant's bookings
    polite.book("h", 0.5, 0.02, tenant="small")  # two tenants share the host now
    assert polite.booked_wait_s("h", "small") == pytest.approx(0.5 + 2 * 0.02)
    now[0] += 1000
    assert polite.booked_wait_s("h", "big") == 0.0
