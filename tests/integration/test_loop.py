"""The shared consume loop (:mod:`shared.bus.loop`) against a real nats-server.

Each test gets its own server (see ``tests/conftest.py``) and waits on events with
deadlines, never on fixed sleeps. Inputs are :class:`DiscoveredLinks` on
``mesh.links.<tenant>.<job>`` consumed by the ``dedup`` consumer; outputs are
:class:`FrontierEntry` messages on ``FRONTIER``, which nothing consumes here.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, RawStreamMsg, RetentionPolicy
from nats.js.errors import NotFoundError

from shared import streams, subjects
from shared.accounts.claims import TenantQuota
from shared.accounts.control import TenantControl
from shared.accounts.keystore import KeyStore
from shared.bus.advisories import MaxDeliveriesAdvisory, MaxDeliveriesHandler
from shared.bus.connection import connect
from shared.bus.loop import ConsumeLoop, Delivery, Handler, Outbound, publish_all
from shared.bus.outcomes import TransientError
from shared.bus.service import LoopSpec, TenantLoops, TenantSupervisor, run_loops
from shared.codec import decode, encode
from shared.contracts import DeadLetter, DiscoveredLinks, FrontierEntry, Link, LinkOrigin
from shared.contracts.base import Contract
from shared.settings import MeshSettings
from shared.subjects import Stage
from tests.integration.handler_proc import fingerprint, frontier_outputs

HANDLER_PROC = Path(__file__).with_name("handler_proc.py")
REPO_ROOT = HANDLER_PROC.parent.parent.parent

T = TypeVar("T")


# ---- helpers -----------------------------------------------------------------------------


async def eventually(
    check: Callable[[], Awaitable[T]], *, what: str, timeout_s: float = 10.0
) -> T:
    """Poll ``check`` every 50 ms until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what} (last: {result!r})")
        await asyncio.sleep(0.05)


async def count(js: JetStreamContext, stream: str) -> int:
    """Messages currently held by ``stream``."""
    return (await js.stream_info(stream)).state.messages


async def stream_msgs(js: JetStreamContext, stream: str) -> list[RawStreamMsg]:
    """Every message ``stream`` holds, in sequence order."""
    state = (await js.stream_info(stream)).state
    found = []
    for seq in range(state.first_seq, state.last_seq + 1):
        with contextlib.suppress(NotFoundError):
            found.append(await js.get_msg(stream, seq))
    return found


async def dead_letters(js: JetStreamContext) -> list[DeadLetter]:
    return [decode(m.data or b"", DeadLetter) for m in await stream_msgs(js, streams.DLQ.name)]


def links_message(tenant: str, job: str, *urls: str) -> DiscoveredLinks:
    return DiscoveredLinks(tenant=tenant, job_id=job, origin=LinkOrigin.SEED, depth=0,
                           links=tuple(Link(url=url) for url in urls))


async def publish_links(
    js: JetStreamContext, tenant: str, job: str, *urls: str,
    headers: dict[str, str] | None = None,
) -> int:
    """Publish one :class:`DiscoveredLinks` with ``urls``; return its LINKS sequence."""
    ack = await js.publish(subjects.links(tenant, job), encode(links_message(tenant, job, *urls)),
                           headers=headers)
    return ack.seq


@contextlib.asynccontextmanager
async def running(
    nc: Client, spec: streams.ConsumerSpec, model: type[Contract], handler: Handler[Any],
    settings: MeshSettings, *, loop_class: type[ConsumeLoop[Any]] = ConsumeLoop,
    concurrency: int | None = None,
) -> AsyncIterator[asyncio.Event]:
    """Run a :class:`ConsumeLoop` in a task; stop it and wait for its drain on exit."""
    stop = asyncio.Event()
    loop = loop_class(nc, spec, model, handler, settings, stop, concurrency=concurrency)
    task = asyncio.create_task(loop.run())
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, settings.shutdown_grace_s + 5)


class Forwarder:
    """Records each delivery, then runs ``behaviour`` (which may raise) and forwards links."""

    def __init__(self, behaviour: Callable[[Delivery], Awaitable[None]] | None = None) -> None:
        self.behaviour = behaviour
        self.deliveries: list[Delivery] = []
        self.times: list[float] = []

    async def handle(self, message: DiscoveredLinks, delivery: Delivery) -> Sequence[Outbound]:
        self.deliveries.append(delivery)
        self.times.append(time.monotonic())
        if self.behaviour is not None:
            await self.behaviour(delivery)
        return frontier_outputs(message)

    @property
    def delivered(self) -> list[int]:
        return [d.delivered for d in self.deliveries]


async def consumer_settled(js: JetStreamContext, spec: streams.ConsumerSpec) -> bool:
    """True when the consumer has nothing delivered-but-unacked and nothing pending."""
    info = await js.consumer_info(spec.stream, spec.durable)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def settled_after(js: JetStreamContext, handler: Forwarder, deliveries: int,
                        tenant: str) -> bool:
    """True once ``handler`` saw ``deliveries`` deliveries and the dedup consumer settled."""
    return len(handler.deliveries) >= deliveries and await consumer_settled(
        js, streams.dedup_consumer(tenant))


def with_settings(settings: MeshSettings, **changes: Any) -> MeshSettings:
    """A validated copy of ``settings`` with ``changes``."""
    return MeshSettings(**{**settings.model_dump(), **changes})


# ---- child processes ---------------------------------------------------------------------


class Child:
    """A ``handler_proc.py`` process whose stdout lines the test waits on."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.lines: list[str] = []

    def diagnostics(self) -> str:
        err = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return f"stdout: {self.lines[-20:]}\nstderr tail:\n{err[-3000:]}"

    async def wait_until(self, condition: Callable[[list[str]], bool], *, what: str,
                         timeout_s: float = 15.0) -> None:
        """Read stdout lines until ``condition(lines)`` holds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while not condition(self.lines):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"timed out waiting for {what}\n{self.diagnostics()}")
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not raw:
                await self.proc.wait()
                pytest.fail(f"child exited ({self.proc.returncode}) before {what}\n"
                            f"{self.diagnostics()}")
            self.lines.append(raw.decode().strip())

    async def finish(self, timeout_s: float) -> int:
        """Wait for exit, collect the rest of stdout, return the exit status."""
        assert self.proc.stdout is not None
        try:
            rest = await asyncio.wait_for(self.proc.stdout.read(), timeout_s)
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            pytest.fail(f"child did not exit within {timeout_s}s\n{self.diagnostics()}")
        self.lines.extend(line.strip() for line in rest.decode().splitlines())
        return self.proc.returncode or 0

    def words(self, first: str) -> list[str]:
        return [line.split(" ", 1)[1] for line in self.lines if line.startswith(first + " ")]


@pytest.fixture
async def spawn(
    child_env: dict[str, str], tmp_path: Path, tenant: str
) -> AsyncIterator[Callable[..., Awaitable[Child]]]:
    """Start ``handler_proc.py`` children; any still running at teardown is SIGKILLed."""
    children: list[Child] = []

    async def start(*args: str, env: dict[str, str] | None = None) -> Child:
        stderr_path = tmp_path / f"child-{len(children)}.log"
        with stderr_path.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(HANDLER_PROC), *args, cwd=REPO_ROOT,
                env={**child_env, "TEST_TENANT": tenant, **(env or {})},
                stdout=asyncio.subprocess.PIPE, stderr=stderr,
            )
        child = Child(proc, stderr_path)
        children.append(child)
        return child

    yield start
    for child in children:
        if child.proc.returncode is None:
            child.proc.kill()
            await child.proc.wait()


# ---- 1. ack after publish ----------------------------------------------------------------


async def test_outputs_are_published_then_input_acked(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str
) -> None:
    urls = ("http://a.example/", "http://b.example/x")
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    seq = await publish_links(js, tenant, job, *urls, headers={"traceparent": traceparent})
    handler = Forwarder()

    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings):
        await eventually(lambda: count(js, streams.FRONTIER.name), what="outputs")
        await eventually(lambda: consumer_settled(js, streams.dedup_consumer(tenant)), what="input acked")

    assert await count(js, streams.LINKS.name) == 0  # work queue: acked means removed
    outputs = await stream_msgs(js, streams.FRONTIER.name)
    entries = [decode(m.data or b"", FrontierEntry) for m in outputs]
    assert sorted(e.url for e in entries) == sorted(urls)
    for msg, entry in zip(outputs, entries, strict=True):
        assert msg.subject == subjects.frontier(subjects.partition_of(entry.host), tenant, job)
        assert msg.headers is not None
        assert msg.headers["Nats-Msg-Id"] == subjects.msg_id(
            Stage.DEDUP, tenant, job, fingerprint(entry.url))
        # the trace travels on (same trace id; the span is the output's producer span)
        assert msg.headers["traceparent"].split("-")[1] == traceparent.split("-")[1]
    [delivery] = handler.deliveries
    assert (delivery.delivered, delivery.stream_seq) == (1, seq)
    assert (delivery.tenant, delivery.job) == (tenant, job)
    assert delivery.headers["traceparent"] == traceparent
    assert await count(js, streams.DLQ.name) == 0


async def test_failed_publish_leaves_input_unacked_for_retry(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str
) -> None:
    """The ack comes only after every PubAck: a publish with no stream behind it is retried."""
    await publish_links(js, tenant, job, "http://a.example/")

    class FirstPublishFails(Forwarder):
        async def handle(self, message: DiscoveredLinks,
                         delivery: Delivery) -> Sequence[Outbound]:
            outputs = list(await super().handle(message, delivery))
            if delivery.delivered == 1:  # no stream listens on this subject: no PubAck
                outputs.append(Outbound("mesh.nowhere.x.y", message, "nowhere:1"))
            return outputs

    handler = FirstPublishFails()
    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings):
        await eventually(lambda: settled_after(js, handler, 2, tenant), what="second delivery acked")

    assert handler.delivered == [1, 2]
    assert await count(js, streams.FRONTIER.name) == 1  # attempt 1's output de-duplicated
    assert await count(js, streams.LINKS.name) == 0
    assert await count(js, streams.DLQ.name) == 0


# ---- 2. redelivery produces no duplicate output ------------------------------------------


async def test_publish_all_twice_stores_one_message(
    js: JetStreamContext, tenant: str, job: str
) -> None:
    [out] = frontier_outputs(links_message(tenant, job, "http://a.example/"))
    await publish_all(js, [out])
    await publish_all(js, [out])
    assert await count(js, streams.FRONTIER.name) == 1


class CrashBeforeFirstAck(ConsumeLoop[Any]):
    """The process "dies" between publishing and acking the first delivery: no settle."""

    async def _settle(self, msg: Any, delivery: Delivery, error: BaseException | None) -> None:
        if delivery.delivered == 1:
            return
        await super()._settle(msg, delivery, error)


async def test_redelivery_after_publish_produces_no_duplicate(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str
) -> None:
    await publish_links(js, tenant, job, "http://a.example/", "http://b.example/")
    handler = Forwarder()

    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings,
                       loop_class=CrashBeforeFirstAck):
        await eventually(lambda: count(js, streams.FRONTIER.name), what="first outputs")
        # Redelivered after the ack wait (1 s), handled again, acked this time.
        await eventually(lambda: settled_after(js, handler, 2, tenant), what="redelivery acked")

    assert handler.delivered == [1, 2]
    assert handler.deliveries[0].stream_seq == handler.deliveries[1].stream_seq
    entries = [decode(m.data or b"", FrontierEntry)
               for m in await stream_msgs(js, streams.FRONTIER.name)]
    assert sorted(e.url for e in entries) == ["http://a.example/", "http://b.example/"]
    assert await count(js, streams.LINKS.name) == 0


# ---- 3. transient errors follow the backoff schedule -------------------------------------


@pytest.mark.parametrize(
    ("retry_after_s", "expected_gaps_s"),
    [(None, (0.5, 1.5)), (1.2, (1.2, 1.2))],
    ids=["backoff-schedule", "retry-after"],
)
async def test_transient_errors_are_retried_on_the_backoff_schedule(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    retry_after_s: float | None, expected_gaps_s: tuple[float, float],
) -> None:
    """Two TransientErrors, then success: retried after backoff[n-1] (or the error's delay)."""
    settings = with_settings(settings, backoff_s=(0.5, 1.5, 1.5))
    await streams.ensure_consumer(js, streams.dedup_consumer(tenant), settings)
    await publish_links(js, tenant, job, "http://a.example/")

    async def fail_twice(delivery: Delivery) -> None:
        if delivery.delivered < 3:
            raise TransientError(f"flaky {delivery.delivered}", retry_after_s=retry_after_s)

    handler = Forwarder(fail_twice)
    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings):
        await eventually(lambda: count(js, streams.FRONTIER.name), what="output")
        await eventually(lambda: consumer_settled(js, streams.dedup_consumer(tenant)), what="input acked")

    assert handler.delivered == [1, 2, 3]
    gaps = [b - a for a, b in zip(handler.times, handler.times[1:], strict=False)]
    for gap, expected in zip(gaps, expected_gaps_s, strict=True):
        # Not before the delay (timer slack only), and not much after it.
        assert expected - 0.05 <= gap < expected + 0.75, (gaps, expected_gaps_s)
    assert await count(js, streams.FRONTIER.name) == 1
    assert await count(js, streams.DLQ.name) == 0


# ---- 4. invalid payloads are dead-lettered at once ---------------------------------------


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"{this is not json", "invalid JSON for DiscoveredLinks"),
        (orjson.dumps({"tenant": "ATESTTENANT", "job_id": "j", "origin": "seed", "depth": -1,
                       "links": [], "colour": "red"}),
         "depth: Input should be greater than or equal to 0; colour: Extra inputs"),
        (b"[1, 2, 3]", "expected a JSON object for DiscoveredLinks"),
    ],
    ids=["bad-json", "wrong-fields", "not-an-object"],
)
async def test_invalid_payload_is_dead_lettered_at_once(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    payload: bytes, expected: str,
) -> None:
    subject = subjects.links(tenant, job)
    seq = (await js.publish(subject, payload, headers={"traceparent": "00-abc-def-01"})).seq
    handler = Forwarder()

    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings):
        await eventually(lambda: count(js, streams.DLQ.name), what="dead letter")
        await eventually(lambda: consumer_settled(js, streams.dedup_consumer(tenant)),
                         what="input terminated")

    assert handler.deliveries == []  # the handler never sees an invalid message
    [raw] = await stream_msgs(js, streams.DLQ.name)
    assert raw.subject == subjects.dlq(Stage.DEDUP, tenant, job)
    assert raw.headers is not None and raw.headers["Nats-Msg-Id"] == f"dlq:LINKS:{seq}"
    letter = decode(raw.data or b"", DeadLetter)
    assert expected in letter.reason
    assert letter.original == payload
    assert (letter.stage, letter.tenant, letter.job_id) == ("dedup", tenant, job)
    assert (letter.stream, letter.stream_seq, letter.subject) == ("LINKS", seq, subject)
    assert letter.id == f"LINKS:{seq}"
    assert letter.delivery_count == 1
    assert letter.headers["traceparent"] == "00-abc-def-01"
    # Terminated: gone from the work queue, never redelivered.
    assert await count(js, streams.LINKS.name) == 0
    info = await js.consumer_info(streams.LINKS.name, streams.dedup_consumer(tenant).durable)
    assert info.num_redelivered == 0 and info.delivered.stream_seq == seq


# ---- 5. a handler that always fails is dead-lettered after max_deliver -------------------


async def test_always_failing_handler_is_dead_lettered_after_max_deliver(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str
) -> None:
    seq = await publish_links(js, tenant, job, "http://a.example/")

    async def boom(delivery: Delivery) -> None:
        raise RuntimeError(f"boom on delivery {delivery.delivered}")

    handler = Forwarder(boom)
    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings):
        await eventually(lambda: count(js, streams.DLQ.name), what="dead letter")
        await eventually(lambda: consumer_settled(js, streams.dedup_consumer(tenant)),
                         what="input terminated")

    assert handler.delivered == [1, 2, 3] == list(range(1, settings.max_deliver + 1))
    [letter] = await dead_letters(js)
    assert letter.delivery_count == settings.max_deliver
    assert letter.reason == "gave up after 3 deliveries: RuntimeError: boom on delivery 3"
    assert (letter.stream_seq, letter.stage, letter.job_id) == (seq, "dedup", job)
    assert letter.original == encode(links_message(tenant, job, "http://a.example/"))
    assert await count(js, streams.LINKS.name) == 0
    assert await count(js, streams.FRONTIER.name) == 0


# ---- 6. a process killed on the last delivery: the advisory path -------------------------


async def test_process_killed_on_last_delivery_is_dead_lettered_by_advisory(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    spawn: Callable[..., Awaitable[Child]],
) -> None:
    seq = await publish_links(js, tenant, job, "http://a.example/")
    original = encode(links_message(tenant, job, "http://a.example/"))
    child = await spawn("hang-last")
    await child.wait_until(lambda lines: f"hanging {seq} 3" in lines,
                           what="the last delivery to reach the handler")
    assert child.words("failing") == [f"{seq} 1", f"{seq} 2"]
    child.proc.send_signal(signal.SIGKILL)
    assert await child.finish(timeout_s=5) == -signal.SIGKILL

    # A replacement replica starts pulling. nats-server 2.15 notices an exhausted pull-consumer
    # message only when a pull request is waiting after the ack wait; it then emits the
    # MAX_DELIVERIES advisory, which the ADVISORIES stream keeps while no advisor runs.
    replacement = Forwarder()
    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, replacement, settings):
        await eventually(lambda: count(js, streams.ADVISORIES.name),
                         what="MAX_DELIVERIES advisory", timeout_s=10)
        assert await count(js, streams.DLQ.name) == 0  # the in-loop path never got to act
        [advisory] = await stream_msgs(js, streams.ADVISORIES.name)
        assert advisory.subject == (f"{streams.ADVISORY_MAX_DELIVERIES}.LINKS."
                                    f"{streams.dedup_consumer(tenant).durable}")

        async with running(nc, streams.DLQ_ADVISOR, MaxDeliveriesAdvisory,
                           MaxDeliveriesHandler(js), settings, concurrency=4):
            await eventually(lambda: count(js, streams.DLQ.name), what="dead letter")
            await eventually(lambda: consumer_settled(js, streams.DLQ_ADVISOR),
                             what="advisory acked")
    assert replacement.deliveries == []  # no fourth delivery

    [letter] = await dead_letters(js)
    assert "max deliveries (3) exhausted" in letter.reason
    assert letter.delivery_count == 3
    assert letter.original == original
    assert (letter.stage, letter.tenant, letter.job_id) == ("dedup", tenant, job)
    assert (letter.stream, letter.stream_seq) == ("LINKS", seq)
    assert letter.subject == subjects.links(tenant, job)
    assert await count(js, streams.LINKS.name) == 0  # deleted from the work queue
    assert await count(js, streams.ADVISORIES.name) == 0


# ---- 7. SIGTERM drains without loss ------------------------------------------------------


async def test_sigterm_drains_in_flight_work_without_loss(
    js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
    spawn: Callable[..., Awaitable[Child]],
) -> None:
    urls = ["http://hang.example/", *(f"http://site-{i}.example/" for i in range(11))]
    for url in urls:
        await publish_links(js, tenant, job, url)
    grace_s = 1.5
    env = {"CRAWLMESH_SHUTDOWN_GRACE_S": str(grace_s), "CRAWLMESH_CONCURRENCY": "3",
           "CRAWLMESH_FETCH_BATCH": "3"}

    first = await spawn("drain", "0.3", "1", env=env)
    await first.wait_until(
        lambda _: "http://hang.example/" in first.words("start") and len(first.words("done")) >= 2,
        what="work in flight")
    first.proc.send_signal(signal.SIGTERM)
    sigterm_at = time.monotonic()
    assert await first.finish(timeout_s=grace_s + 10) == 0, first.diagnostics()
    assert time.monotonic() - sigterm_at < grace_s + 4
    assert first.lines[-1] == "exited"

    done_first = first.words("done")
    started_first = first.words("start")
    outputs = [decode(m.data or b"", FrontierEntry).url
               for m in await stream_msgs(js, streams.FRONTIER.name)]
    remaining = await count(js, streams.LINKS.name)
    # Every handler that finished published; the hanging one was nak'd, not lost.
    assert sorted(outputs) == sorted(done_first)
    assert "http://hang.example/" not in outputs
    assert set(started_first) - set(done_first) == {"http://hang.example/"}
    assert len(outputs) + remaining == len(urls)
    assert remaining >= 1

    second = await spawn("drain", "0.05", "0", env=env)
    await eventually(
        lambda: _all_forwarded(js, len(urls)), what="all inputs forwarded", timeout_s=20)
    second.proc.send_signal(signal.SIGTERM)
    assert await second.finish(timeout_s=grace_s + 10) == 0, second.diagnostics()

    final = [decode(m.data or b"", FrontierEntry).url
             for m in await stream_msgs(js, streams.FRONTIER.name)]
    assert sorted(final) == sorted(urls)  # each input exactly once, no duplicates
    assert "http://hang.example/" in second.words("done")
    assert await count(js, streams.LINKS.name) == 0
    assert await count(js, streams.DLQ.name) == 0


async def _all_forwarded(js: JetStreamContext, expected: int) -> bool:
    return (await count(js, streams.FRONTIER.name) == expected
            and await count(js, streams.LINKS.name) == 0)


async def test_stop_with_every_slot_busy_is_bounded_by_the_grace_period(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str
) -> None:
    """Stop is honoured even when every handler slot is stuck; the stuck work is nak'd."""
    settings = with_settings(settings, shutdown_grace_s=1.0)
    seq = await publish_links(js, tenant, job, "http://stuck.example/")
    started = asyncio.Event()

    async def stick(delivery: Delivery) -> None:
        started.set()
        await asyncio.Event().wait()

    handler = Forwarder(stick)
    stop = asyncio.Event()
    loop = ConsumeLoop(nc, streams.dedup_consumer(tenant), DiscoveredLinks, handler, settings, stop,
                       concurrency=1)
    task = asyncio.create_task(loop.run())
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    stopped_at = time.monotonic()
    await asyncio.wait_for(task, settings.shutdown_grace_s + 3)
    assert time.monotonic() - stopped_at < settings.shutdown_grace_s + 1.5

    # Nak'd, not lost: the message is still there and is redelivered at once.
    assert await count(js, streams.LINKS.name) == 1
    again = Forwarder()
    async with running(nc, streams.dedup_consumer(tenant), DiscoveredLinks, again, settings):
        await eventually(lambda: settled_after(js, again, 1, tenant), what="redelivery acked",
                         timeout_s=5)
    assert [(d.stream_seq, d.delivered) for d in again.deliveries] == [(seq, 2)]


# ---- 8. streams and consumers follow settings, idempotently ------------------------------


async def test_ensure_is_idempotent_and_follows_settings(
    js: JetStreamContext, settings: MeshSettings, tenant: str, job: str
) -> None:
    await publish_links(js, tenant, job, "http://a.example/")
    names = sorted([s.config.name for s in await js.streams_info()])
    await streams.ensure_mesh(js, settings)
    await streams.ensure_mesh(js, settings)
    await streams.ensure_tenant(js, tenant, settings)
    assert sorted([s.config.name for s in await js.streams_info()]) == names
    assert {spec.name for spec in streams.MESH_STREAMS} <= set(names)
    assert f"INTAKE_{tenant}" in names
    assert not {"RESULTS", "EVENTS"} & set(names)  # those live in the tenant's account
    tenant_nc = await connect(settings, "t", persistent=False,
                              creds=KeyStore(settings.home).tenant_creds("test"))
    try:
        tjs = tenant_nc.jetstream()
        assert {s.config.name for s in await tjs.streams_info()} == {"RESULTS", "EVENTS"}
    finally:
        await tenant_nc.close()

    links = (await js.stream_info(streams.LINKS.name)).config
    assert links.max_bytes == settings.stage_max_bytes
    assert links.num_replicas == settings.replicas
    assert links.duplicate_window == settings.duplicate_window_s
    assert links.retention == RetentionPolicy.WORK_QUEUE
    assert not links.allow_rollup_hdrs and not links.allow_msg_ttl
    assert not links.allow_msg_schedules
    dedup = (await js.consumer_info(streams.LINKS.name,
                                    streams.dedup_consumer(tenant).durable)).config
    assert dedup.max_deliver == 3 and dedup.backoff == [1.0, 1.0, 1.0]
    assert dedup.ack_wait == 1.0 and dedup.ack_policy == AckPolicy.EXPLICIT

    changed = with_settings(settings, stage_max_bytes=32 << 20, stage_max_msgs_per_subject=100,
                            max_deliver=5, backoff_s=(0.5, 2.0, 4.0), max_ack_pending=64)
    await streams.ensure_mesh(js, changed)
    await streams.ensure_tenant(js, tenant, changed)

    links = (await js.stream_info(streams.LINKS.name)).config
    assert links.max_bytes == 32 << 20
    assert links.max_msgs_per_subject == 100 and links.discard_new_per_subject
    assert links.duplicate_window == changed.duplicate_window_s
    assert (await js.stream_info(streams.DLQ.name)).config.max_msgs_per_subject == -1
    for spec in streams.tenant_stage_consumers(tenant):
        config = (await js.consumer_info(spec.stream, spec.durable)).config
        assert config.max_deliver == 5, spec.durable
        assert config.backoff == [0.5, 2.0, 4.0], spec.durable
        assert config.ack_wait == 0.5 and config.max_ack_pending == 64, spec.durable
    # the fetcher's: every step at least fetcher_ack_wait_s (a redelivery is a second request)
    fetcher = (await js.consumer_info(streams.FRONTIER.name,
                                      streams.fetcher_partition(0).durable)).config
    assert fetcher.backoff == [1.0, 2.0, 4.0] and fetcher.ack_wait == 1.0
    assert fetcher.max_deliver == 5 and fetcher.max_ack_pending == 64
    advisor = (await js.consumer_info(streams.ADVISORIES.name, "dlq-advisor")).config
    assert advisor.max_deliver == -1
    assert await count(js, streams.LINKS.name) == 1  # updates keep what is stored
    await streams.verify(js, streams.MESH_CONSUMERS)


# ---- 9. per-tenant loops follow the tenant registry --------------------------------------


async def test_a_tenant_added_at_run_time_is_served_and_a_removed_one_is_not(
    nc: Client, js: JetStreamContext, settings: MeshSettings,
) -> None:
    """The seeder's per-tenant intake loop starts for a tenant added while it runs (its
    crawl limits enforced at submission) and stops when the tenant is removed."""
    from services.seeder.main import setup as seeder_setup

    stop = asyncio.Event()
    (per_tenant,) = await seeder_setup(nc, settings)
    supervisor = TenantSupervisor(nc, settings, [per_tenant], stop, poll_s=0.2)  # type: ignore[list-item]
    task = asyncio.create_task(supervisor.run())
    try:
        async with TenantControl.open(settings) as control:
            late = await control.add("late", TenantQuota(max_pages_per_job=20))
        tenant_nc = await connect(settings, "late", persistent=False,
                                  creds=KeyStore(settings.home).tenant_creds("late"))
        try:
            tjs = tenant_nc.jetstream()
            await tjs.publish("crawl.seeds", orjson.dumps(
                {"seeds": ["https://site.test/"], "job_id": "ok"}))
            await tjs.publish("crawl.seeds", orjson.dumps(
                {"seeds": ["https://site.test/"], "job_id": "big", "max_pages": 21}))

            async def event_of(job: str) -> dict[str, Any] | None:
                try:
                    msg = await tjs.get_last_msg("EVENTS", f"crawl.events.{job}")
                except NotFoundError:
                    return None
                return orjson.loads(msg.data)

            assert (await eventually(lambda: event_of("ok"), what="the started event"))["kind"] \
                == "started"
            big = await eventually(lambda: event_of("big"), what="the rejected event")
            assert big["kind"] == "rejected"
            assert big["reason"] == "max_pages 21 exceeds this tenant's limit of 20 pages per job"
        finally:
            await tenant_nc.close()
        assert (late.id, "seeder") in supervisor.running

        async with TenantControl.open(settings) as control:
            await control.remove("late")

        async def stopped() -> bool:
            return (late.id, "seeder") not in supervisor.running

        await eventually(stopped, what="the removed tenant's loop to stop")
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


# ---- fairness: tenants take turns for a stage's shared slots ------------------------------


async def test_tenants_take_turns_for_shared_slots(
    nc: Client, js: JetStreamContext, settings: MeshSettings, tenant: str, job: str,
) -> None:
    """Tenant A queues 60 messages before tenant B queues 5. With one consumer per tenant
    sharing 2 handler slots (``TenantLoops.shared_slots``), B's messages are handled
    among A's first ones instead of after A's whole backlog (one FIFO would put them last)."""
    async with TenantControl.open(settings) as control:
        other = (await control.add("other")).id
    for i in range(60):
        await publish_links(js, tenant, job, f"http://a.example/{i}")
    for i in range(5):
        await publish_links(js, other, job, f"http://b.example/{i}")

    async def slow(_: Delivery) -> None:
        await asyncio.sleep(0.02)

    handler = Forwarder(slow)
    loops = TenantLoops(
        "dedup", lambda t: LoopSpec(streams.dedup_consumer(t), DiscoveredLinks, handler),
        shared_slots=2)
    stop = asyncio.Event()
    task = asyncio.create_task(run_loops(nc, settings, [loops], stop, poll_s=0.2))
    try:
        await eventually(lambda: asyncio.sleep(0, len(handler.deliveries) >= 65),
                         what="every message handled", timeout_s=30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    order = [d.tenant for d in handler.deliveries]
    last_b = max(i for i, t in enumerate(order) if t == other)
    assert last_b < 30, f"tenant B's last message was handled {last_b + 1}th of 65: {order}"
