"""``crawlmesh crawl``, ``submit``, ``status``, ``cancel``, ``results``: a tenant's jobs.

A tenant's side is its own NATS account: the CLI connects with a tenant user's creds file
(``--creds F``, or, on the mesh host, ``<home>/creds/tenants/<name>.creds`` written by
``crawlmesh init``/``tenant add``), publishes the :class:`CrawlRequest` on the local intake
subject ``crawl.seeds``, and reads ``crawl.events.<job>`` (stream ``EVENTS``) and
``crawl.results.<job>`` (stream ``RESULTS``) in that account. The request carries the job
id (chosen here), so the seeder's ``started`` or ``rejected`` event for it is found
without any reply crossing accounts. On the mesh host the operator commands also use a
MESH connection: the ledger for live progress between events, the job records for
``status`` and ``cancel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import orjson
import typer
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from shared import subjects
from shared.accounts.keystore import KeyStore
from shared.bus.connection import connect, keep_reconnecting
from shared.cli.progress import JobProgress
from shared.codec import decode, describe, encode
from shared.contracts import (
    CrawlRequest,
    JobCounters,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    Scope,
    ScopeMode,
)
from shared.jobs import JobNotFoundError, JobStore, job_key, ledger_counts
from shared.settings import MeshSettings
from shared.streams import EVENTS, JOBS_BUCKET, RESULTS
from shared.tenancy import DEFAULT_TENANT, TenantError, TenantRegistry

console = Console(stderr=True, soft_wrap=True)  # one message, one line (logs, grep)
T = TypeVar("T")

INTAKE_SUBJECT = "crawl.seeds"
"""Where a tenant user publishes crawl requests (its own slot of MESH's intake)."""

TERMINAL = frozenset({JobEventKind.COMPLETED, JobEventKind.CANCELLED, JobEventKind.REJECTED})


def results_subject(job: str) -> str:
    """Tenant-side subject of a job's results (stream ``RESULTS``)."""
    return f"crawl.results.{subjects.check_token(job, 'job id')}"


def events_subject(job: str | None = None) -> str:
    """Tenant-side subject of a job's events (every job's when None; stream ``EVENTS``)."""
    return f"crawl.events.{subjects.check_token(job, 'job id')}" if job else "crawl.events.>"


class CrawlError(RuntimeError):
    """The crawl was rejected, the job is unknown or the mesh is unreachable; says why."""


# ---- connections ----------------------------------------------------------------------------


def active_settings() -> MeshSettings:
    """Settings pointing at the mesh `crawlmesh up` runs from the home folder, if any."""
    from shared.launcher import running_mesh

    settings = MeshSettings()
    state = running_mesh(settings.home)
    return settings.model_copy(update={"nats_url": str(state["url"])}) if state else settings


def tenant_creds_path(settings: MeshSettings, tenant: str) -> Path:
    """The creds file of tenant ``tenant``'s user on the mesh host.

    Raises:
        CrawlError: there is none (no such tenant, or `crawlmesh init` not run).
    """
    path = KeyStore(settings.home).tenant_creds(tenant)
    if not path.exists():
        raise CrawlError(f"no creds file for tenant {tenant!r} ({path}): run `crawlmesh init` "
                         f"(default tenant) or `crawlmesh tenant add {tenant}`")
    return path


async def connect_or_explain(settings: MeshSettings, creds: Path | None = None,
                             name: str = "crawlmesh-cli") -> Client:
    """Connect as the MESH user (``creds`` None) or as the user of the creds file ``creds``.

    Raises:
        CrawlError: the creds file is missing, the server refuses the user (revoked,
            expired, removed account) or cannot be reached.
    """
    if creds is not None and not creds.exists():  # noqa: ASYNC240 - one stat
        raise CrawlError(f"creds file {creds} does not exist")
    if creds is not None:
        check_creds_file(creds)
    if creds is None:
        try:
            return await connect(settings, name=name, persistent=False)
        except (nats.errors.NoServersError, OSError) as error:
            raise CrawlError(f"cannot reach NATS at {settings.nats_url}: {error} "
                             "(start the mesh with `crawlmesh up`)") from None
    errors: list[str] = []

    async def note(error: Exception) -> None:
        errors.append(str(error))

    try:  # not shared.bus.connection.connect: the server's refusal must be reported
        nc = await nats.connect(
            servers=[url.strip() for url in settings.nats_url.split(",")], name=name,
            user_credentials=str(creds), connect_timeout=settings.nats_connect_timeout_s,
            max_reconnect_attempts=3, reconnect_time_wait=0.5, error_cb=note)
        try:
            # A removed account is looked up by the server for a while before the refusal.
            await nc.flush(timeout=7)
            if errors:
                raise nats.errors.Error(errors[-1])
        except BaseException:
            await nc.close()
            raise
        return keep_reconnecting(nc)
    except (nats.errors.NoServersError, OSError, nats.errors.Error) as error:
        refused = [e for e in errors if "authori" in e.lower() or "authenti" in e.lower()
                   or "expired" in e.lower()]
        if refused or _reachable(settings.nats_url):
            why = refused[-1] if refused else str(error) or type(error).__name__
            raise CrawlError(f"NATS at {settings.nats_url} did not accept the user of {creds}: "
                             f"{why} (tenant suspended or removed, or the creds were rotated "
                             "or expired?)") from None
        raise CrawlError(f"cannot reach NATS at {settings.nats_url}: {error} "
                         "(start the mesh with `crawlmesh up`)") from None


def check_creds_file(creds: Path) -> None:
    """Raise :class:`CrawlError` unless ``creds`` reads as a NATS user creds file: a user JWT
    whose signature verifies, and a user nkey seed (``SU...``)."""
    from shared.accounts.jwt import JwtError, decode, read_creds_jwt

    try:
        text = creds.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise CrawlError(f"cannot read creds file {creds}: {error}") from None
    try:
        decode(read_creds_jwt(text), claim_type="user")
    except JwtError as error:
        raise CrawlError(f"{creds} is not a NATS user creds file: {error}") from None
    if "-----BEGIN USER NKEY SEED-----" not in text or "\nSU" not in text:
        raise CrawlError(f"{creds} is not a NATS user creds file: no user nkey seed")


def _reachable(url: str) -> bool:
    from shared.cli.mesh import _reachable as reachable

    return reachable(url)


def _quiet_resets(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop nats-py's "Task exception was never retrieved" for a connection the server
    reset (a refused user); anything else goes to the default handler."""
    if isinstance(context.get("exception"), ConnectionResetError):
        return
    loop.default_exception_handler(context)


async def _tenant_id(nc: Client, tenant: str) -> str:
    try:
        return await TenantRegistry(nc.jetstream()).resolve(tenant)
    except TenantError as error:
        raise CrawlError(str(error)) from None


# ---- the tenant side ------------------------------------------------------------------------


async def read_events(tjs: JetStreamContext, job: str | None = None) -> list[JobEvent]:
    """Every event stored in the tenant's ``EVENTS`` stream for ``job`` (every job: None)."""
    subject = events_subject(job)
    try:
        if job is None:
            if (await tjs.stream_info(EVENTS)).state.messages == 0:
                return []
        else:
            await tjs.get_last_msg(EVENTS, subject)
    except NotFoundError:
        return []
    sub = await tjs.subscribe(subject, stream=EVENTS, ordered_consumer=True,
                              deliver_policy=DeliverPolicy.ALL)
    out: list[JobEvent] = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except (NatsTimeoutError, TimeoutError):
                break
            with contextlib.suppress(ValueError):
                out.append(decode(msg.data, JobEvent))
            if msg.metadata.num_pending == 0:
                break
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return out


@dataclass
class JobSummary:
    """A job as its events tell it (what a tenant can know without the mesh's records)."""

    job_id: str
    state: str = JobState.RUNNING.value
    started_at: str | None = None
    finished_at: str | None = None
    counters: JobCounters | None = None
    reason: str | None = None

    def observe(self, event: JobEvent) -> None:
        if event.kind is JobEventKind.STARTED:
            self.started_at = self.started_at or event.at.isoformat()
        elif event.kind in TERMINAL:
            self.state = event.kind.value
            self.finished_at = event.at.isoformat()
        if event.kind is not JobEventKind.STARTED:
            self.counters = event.counters
        if event.reason:
            self.reason = event.reason

    def as_json(self) -> dict[str, Any]:
        counters = self.counters or JobCounters()
        return {"job_id": self.job_id, "state": self.state, "started_at": self.started_at,
                "finished_at": self.finished_at, **counters.model_dump(),
                "reason": self.reason}


def summarise(events: list[JobEvent]) -> list[JobSummary]:
    """One summary per job, in the order the jobs first appear."""
    jobs: dict[str, JobSummary] = {}
    for event in events:
        jobs.setdefault(event.job_id, JobSummary(event.job_id)).observe(event)
    return list(jobs.values())


async def wait_for_event(tjs: JetStreamContext, job: str, kinds: frozenset[JobEventKind],
                         timeout_s: float, after_seq: int = 0) -> JobEvent:
    """The first event of ``job`` whose kind is in ``kinds``, among those stored after the
    ``EVENTS`` sequence ``after_seq`` or still to come.

    Raises:
        CrawlError: none within ``timeout_s``.
    """
    sub = await tjs.subscribe(events_subject(job), stream=EVENTS, ordered_consumer=True,
                              deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                              config=ConsumerConfig(opt_start_seq=after_seq + 1))
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                msg = await sub.next_msg(timeout=None)
                event = decode(msg.data, JobEvent)
                if event.kind in kinds:
                    return event
    except TimeoutError:
        raise CrawlError(f"no answer from the seeder for job {job} within {timeout_s:.0f}s "
                         "(is the mesh running? `crawlmesh up`)") from None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def submit(tnc: Client, request: CrawlRequest, timeout_s: float = 30) -> str:
    """Publish ``request`` on the tenant's intake (``crawl.seeds``) and wait for the seeder's
    ``started`` event in the tenant's ``EVENTS``. ``tnc`` is a tenant user's connection.

    Returns the job id (``request.job_id``, or a new one).

    Raises:
        CrawlError: rejected (with the seeder's reason), the intake refused the message,
            or no answer within ``timeout_s``.
    """
    chosen, job = request.job_id is not None, request.job_id or subjects.new_job_id()
    request = request.model_copy(update={"job_id": job, "reply_to": None})
    tjs = tnc.jetstream()
    try:
        after = (await tjs.stream_info(EVENTS)).state.last_seq
    except nats.js.errors.NotFoundError:
        raise CrawlError("this user's account has no EVENTS stream: these are not a tenant's "
                         "creds (`crawlmesh tenant show NAME` says where its creds are)") from None
    if chosen and await read_events(tjs, job):
        raise CrawlError(f"crawl rejected: job id {job!r} is already in use")
    payload = encode(request)
    if len(payload) > tnc.max_payload:
        raise CrawlError(f"crawl request is {len(payload):,} bytes, over the server's limit of "
                         f"{tnc.max_payload:,} bytes per message: split the seeds into several "
                         "crawls")
    try:
        ack = await tjs.publish(INTAKE_SUBJECT, payload, timeout=10,
                                headers={"Nats-Msg-Id": f"submit:{job}"})
    except NoRespondersError:
        raise CrawlError("the intake did not answer (no mesh streams for this tenant? "
                         "`crawlmesh init`)") from None
    except nats.js.errors.APIError as error:
        raise CrawlError(f"the intake refused the request: {error}") from None
    if ack.duplicate:
        raise CrawlError(f"crawl rejected: job id {job!r} was submitted already")
    event = await wait_for_event(tjs, job, frozenset({JobEventKind.STARTED,
                                                      JobEventKind.REJECTED}), timeout_s, after)
    if event.kind is JobEventKind.REJECTED:
        raise CrawlError(f"crawl rejected: {event.reason}")
    return job


async def wait_for_job(
    tnc: Client, job: str, show: bool, budget: int | None = None,
    counts: Callable[[], Awaitable[JobCounters]] | None = None,
) -> JobEvent:
    """Follow the job's events (tenant connection ``tnc``) until it completes, is cancelled
    or rejected, showing progress (:class:`shared.cli.progress.JobProgress`: a bar on a
    terminal, lines otherwise) from its ``progress`` events, and between them from
    ``counts()`` when given (the operator reads the ledger; a failed read, e.g. while
    nats-server restarts, skips that update instead of ending the wait). The events come
    from an ordered consumer, which nats-py re-creates after missed heartbeats, so a
    server restart delays the wait but does not end it.

    Returns the final event.
    """
    sub = await tnc.jetstream().subscribe(events_subject(job), stream=EVENTS,
                                          ordered_consumer=True,
                                          deliver_policy=DeliverPolicy.ALL)
    try:
        with JobProgress.for_console(job, console, show, budget) as progress:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except (NatsTimeoutError, TimeoutError):
                    if counts is not None:
                        with contextlib.suppress(Exception):  # e.g. NATS restarting: later
                            progress.update(await asyncio.wait_for(counts(), 10.0))
                    continue
                event = decode(msg.data, JobEvent)
                if event.kind in TERMINAL:
                    progress.update(event.counters, final=True)
                    return event
                if event.kind is JobEventKind.PROGRESS:
                    progress.update(event.counters)
                if event.reason:
                    console.print(f"job {job}: {escape(event.reason)}")
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def job_ended(tjs: JetStreamContext, job: str) -> bool:
    """True if the job's last stored event is final (completed, cancelled, rejected)."""
    try:
        msg = await tjs.get_last_msg(EVENTS, events_subject(job))
    except NotFoundError:
        return False
    return decode(msg.data, JobEvent).kind in TERMINAL


async def export_results(tnc: Client, job: str, output: Path | None,
                         follow: bool = False) -> int:
    """Write the job's results (tenant stream ``RESULTS``, ``crawl.results.<job>``) as JSON
    lines to ``output`` (stdout when None). ``tnc`` is a tenant user's connection.

    With ``follow``, keep printing new results until the job has ended.
    Returns how many results were written.
    """
    tjs = tnc.jetstream()
    sub = await tjs.pull_subscribe(
        results_subject(job), durable=None, stream=RESULTS,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy="none",
                              inactive_threshold=60.0, max_ack_pending=-1),
    )
    handle = output.open("wb") if output else sys.stdout.buffer
    count = 0
    try:
        while True:
            try:
                msgs = await sub.fetch(512, timeout=1.0)
            except (NatsTimeoutError, TimeoutError):
                msgs = []
            for msg in msgs:
                handle.write(msg.data + b"\n")
                count += 1
            if msgs:
                handle.flush()
                continue
            if follow and await job_ended(tjs, job):
                follow = False  # one more round picks up what came with the last event
                continue
            if not follow and (await sub.consumer_info()).num_pending == 0:
                break
        handle.flush()
    finally:
        if output:
            handle.close()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return count


# ---- the operator side (MESH connection on the mesh host) -----------------------------------


async def cancel_job(js: JetStreamContext, tenant_id: str, job: str, reason: str) -> bool:
    """Move a running job to cancelled and publish its ``cancelled`` event (MESH ``js``).

    Returns True if this call cancelled it (False: it was not running).

    Raises:
        JobNotFoundError: no such job.
    """
    counts = await ledger_counts(js, tenant_id, job)
    changed = await JobStore(js).transition(tenant_id, job, JobState.CANCELLED, counts)
    if changed:
        event = JobEvent(tenant=tenant_id, job_id=job, kind=JobEventKind.CANCELLED,
                         counters=counts, reason=reason)
        await js.publish(subjects.events(tenant_id, job), encode(event),
                         headers={"Nats-Msg-Id": f"cli:{tenant_id}:{job}:cancelled"})
    return changed


async def _ended_record(js: JetStreamContext, tenant_id: str, job: str,
                        timeout_s: float = 5.0) -> JobRecord:
    """The job's record once it is no longer running (it changes just after the final
    event), or as it is after ``timeout_s`` seconds."""
    watcher = await (await js.key_value(JOBS_BUCKET)).watch(job_key(tenant_id, job))
    try:
        async with asyncio.timeout(timeout_s):
            async for entry in watcher:
                record = decode(entry.value, JobRecord) if entry and entry.value else None
                if record is not None and record.state is not JobState.RUNNING:
                    return record
    except TimeoutError:
        pass
    finally:
        await watcher.stop()
    return (await JobStore(js).get(tenant_id, job))[0]


@dataclass
class Session:
    """Connections of one command: the tenant user's (``tenant``) and, for the operator on
    the mesh host, MESH's (``mesh``, None with ``--creds``) with the tenant's id."""

    settings: MeshSettings
    tenant: Client
    mesh: Client | None = None
    tenant_id: str | None = None
    name: str | None = None

    async def counts(self, job: str) -> JobCounters:
        assert self.mesh is not None and self.tenant_id is not None
        return await ledger_counts(self.mesh.jetstream(), self.tenant_id, job)


@contextlib.asynccontextmanager
async def open_session(settings: MeshSettings, creds: Path | None, tenant: str):  # type: ignore[no-untyped-def]
    """A :class:`Session`: with ``creds``, the tenant user only; without, MESH plus the
    creds file of tenant ``tenant`` from the home folder."""
    mesh = None
    tenant_id = None
    try:
        if creds is None:
            mesh = await connect_or_explain(settings, name="crawlmesh-cli-mesh")
            tenant_id = await _tenant_id(mesh, tenant)
            creds = tenant_creds_path(settings, tenant)
        tnc = await connect_or_explain(settings, creds)
        try:
            yield Session(settings, tnc, mesh, tenant_id, None if mesh is None else tenant)
        finally:
            await tnc.close()
    finally:
        if mesh is not None:
            await mesh.close()


def run_session(settings: MeshSettings, creds: Path | None, tenant: str,
                work: Callable[[Session], Awaitable[T]]) -> T:
    """Run ``work`` in a session; errors are printed and exit with status 1."""

    async def run() -> T:
        asyncio.get_running_loop().set_exception_handler(_quiet_resets)
        async with open_session(settings, creds, tenant) as session:
            return await work(session)

    try:
        return asyncio.run(run())
    except JobNotFoundError as error:
        job = error.args[1] if len(error.args) > 1 else error
        console.print(f"[red]no job {escape(repr(job))} for tenant {escape(repr(tenant))}[/]")
        raise typer.Exit(1) from None
    except (CrawlError, TenantError, ValueError) as error:
        console.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(1) from None


def _request(seeds: list[str], **fields: Any) -> CrawlRequest:
    try:
        return CrawlRequest(seeds=tuple(seeds), **fields)
    except ValidationError as error:
        console.print(f"[red]{escape(describe(error, 'crawl request'))}[/]")
        raise typer.Exit(2) from None


CREDS_HELP = "A tenant user's creds file (`crawlmesh tenant add` prints where it is)."
TENANT_HELP = "Tenant name (operator on the mesh host: uses its creds file in the home folder)."


# ---- commands -------------------------------------------------------------------------------


async def run_crawl(settings: MeshSettings, tenant: str, request: CrawlRequest, wait: bool,
                    output: Path | None) -> int:
    """Submit as ``tenant``, optionally wait and export. Returns the exit status."""
    async with open_session(settings, None, tenant) as session:
        started = time.monotonic()
        job = await submit(session.tenant, request)
        console.print(f"job [bold]{job}[/] accepted")
        if not wait:
            typer.echo(job)
            return 0
        main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stop like Ctrl-C does
            loop.add_signal_handler(sig, main.cancel if main else lambda: None)
        try:
            event = await wait_for_job(session.tenant, job, show=True, budget=request.max_pages,
                                       counts=lambda: session.counts(job))
        except asyncio.CancelledError:  # interrupted: stop the crawl, not just the waiting
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    assert session.mesh is not None and session.tenant_id is not None
                    if await cancel_job(session.mesh.jetstream(), session.tenant_id, job,
                                        "interrupted"):
                        console.print(f"interrupted: job {job} cancelled")
            raise
        elapsed = time.monotonic() - started
        c = event.counters
        console.print(f"job {job} {event.kind}: {c.finished} pages finished "
                      f"({c.failed} failed) of {c.admitted} admitted in {elapsed:.1f}s")
        if output is not None:
            count = await export_results(session.tenant, job, output)
            console.print(f"{count} results written to {output}")
        typer.echo(job)
        return 0 if event.kind is JobEventKind.COMPLETED else 1


def crawl(
    seeds: list[str] = typer.Argument(..., help="Seed URLs (http/https)."),
    tenant: str = typer.Option(DEFAULT_TENANT, help=TENANT_HELP),
    max_pages: int = typer.Option(10_000, help="Most pages admitted for the job."),
    max_depth: int = typer.Option(3, help="Most link hops from a seed."),
    max_pages_per_host: int = typer.Option(0, help="Most pages per host (0: no cap)."),
    scope: ScopeMode = typer.Option(ScopeMode.SAME_HOST, help="Which links to follow."),
    wait: bool = typer.Option(False, "--wait", help="Show progress and exit when complete."),
    output: Path | None = typer.Option(None, help="With --wait: write results (JSON lines)."),
    embedded: bool = typer.Option(True, help="Start the embedded mesh if none is running."),
) -> None:
    """Submit a crawl of SEEDS as a tenant (prints the job id); with --wait, follow it to
    completion. Starts the embedded mesh if none runs."""
    from shared.cli.mesh import ensure_mesh_running, mesh_available

    request = _request(seeds, max_pages=max_pages, max_depth=max_depth,
                       max_pages_per_host=max_pages_per_host, scope=Scope(mode=scope))
    for sig in (signal.SIGTERM, signal.SIGHUP):  # until the crawl runs: like Ctrl-C
        signal.signal(sig, signal.default_int_handler)
    settings = MeshSettings()
    if not (wait or output) and embedded and not mesh_available(settings):
        console.print("no mesh is running: the embedded one started now lives as long as this "
                      "command, so it waits for the job (use `crawlmesh up` to keep one running)")
        wait = True
    with ensure_mesh_running(settings, allowed=embedded) as active:
        try:
            status = asyncio.run(run_crawl(active, tenant, request, wait or bool(output), output))
        except (KeyboardInterrupt, asyncio.CancelledError):
            status = 130
        except (CrawlError, TenantError) as error:
            console.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(1) from None
    raise typer.Exit(status)


def submit_command(
    seeds: list[str] = typer.Argument(..., help="Seed URLs (http/https)."),
    creds: Path = typer.Option(..., help=CREDS_HELP),
    max_pages: int = typer.Option(10_000, help="Most pages admitted for the job."),
    max_depth: int = typer.Option(3, help="Most link hops from a seed."),
    max_pages_per_host: int = typer.Option(0, help="Most pages per host (0: no cap)."),
    scope: ScopeMode = typer.Option(ScopeMode.SAME_HOST, help="Which links to follow."),
    job_id: str | None = typer.Option(None, help="Choose the job id (default: a new one)."),
    wait: bool = typer.Option(False, "--wait", help="Show progress and exit when it ends."),
) -> None:
    """Submit a crawl with a tenant user's creds file; print the job id."""
    request = _request(seeds, max_pages=max_pages, max_depth=max_depth, job_id=job_id,
                       max_pages_per_host=max_pages_per_host, scope=Scope(mode=scope))

    async def run(session: Session) -> int:
        job = await submit(session.tenant, request)
        console.print(f"job [bold]{job}[/] accepted")
        if not wait:
            typer.echo(job)
            return 0
        event = await wait_for_job(session.tenant, job, show=True, budget=request.max_pages)
        c = event.counters
        console.print(f"job {job} {event.kind}: {c.finished} pages finished "
                      f"({c.failed} failed) of {c.admitted} admitted")
        typer.echo(job)
        return 0 if event.kind is JobEventKind.COMPLETED else 1

    raise typer.Exit(run_session(active_settings(), creds, DEFAULT_TENANT, run))


def status(
    job: str | None = typer.Argument(None, help="Job id (all jobs when omitted)."),
    creds: Path | None = typer.Option(None, help=CREDS_HELP + " Reads the tenant's EVENTS."),
    tenant: str = typer.Option(DEFAULT_TENANT, help=TENANT_HELP),
    follow: bool = typer.Option(False, "--follow",
                                help="Show the job's progress until it ends, then its status."),
) -> None:
    """Show a job's state and counters, or list the tenant's jobs (JSON lines)."""
    if follow and job is None:
        raise typer.BadParameter("needs a JOB", param_hint="--follow")

    async def from_events(session: Session) -> None:
        tjs = session.tenant.jetstream()
        if follow and job and not await job_ended(tjs, job):
            await wait_for_job(session.tenant, job, show=True)
        summaries = summarise(await read_events(tjs, job))
        if job and not summaries:
            raise CrawlError(f"no job {job!r}: no events for it in this tenant's EVENTS")
        for summary in summaries:
            typer.echo(orjson.dumps(summary.as_json()).decode())

    async def from_records(session: Session) -> None:
        assert session.mesh is not None and session.tenant_id is not None
        js, tenant_id = session.mesh.jetstream(), session.tenant_id
        store = JobStore(js)
        records = [(await store.get(tenant_id, job))[0]] if job else await store.all(tenant_id)
        if follow and job and records[0].state is JobState.RUNNING:
            await wait_for_job(session.tenant, job, show=True,
                               counts=lambda: session.counts(job))
            records = [await _ended_record(js, tenant_id, job)]
        for record in records:
            counts = record.counters or await ledger_counts(js, tenant_id, record.job_id)
            typer.echo(orjson.dumps({
                "job_id": record.job_id, "state": record.state,
                "created_at": record.created_at.isoformat(),
                "finished_at": record.finished_at.isoformat() if record.finished_at else None,
                "seeds": list(record.request.seeds), **counts.model_dump(),
            }).decode())

    try:
        run_session(active_settings(), creds, tenant,
                    from_events if creds is not None else from_records)
    except KeyboardInterrupt:  # stop watching; the job goes on
        raise typer.Exit(130) from None


def cancel(
    job: str = typer.Argument(..., help="Job id."),
    tenant: str = typer.Option(DEFAULT_TENANT, help=TENANT_HELP),
) -> None:
    """Cancel a running job (operator, on the mesh host): nothing more is admitted or fetched."""

    async def run(session: Session) -> bool:
        assert session.mesh is not None and session.tenant_id is not None
        return await cancel_job(session.mesh.jetstream(), session.tenant_id, job,
                                "cancelled by request")

    changed = run_session(active_settings(), None, tenant, run)
    console.print(f"job {job} cancelled" if changed else f"job {job} was not running")


def results(
    job: str = typer.Argument(..., help="Job id."),
    creds: Path | None = typer.Option(None, help=CREDS_HELP),
    tenant: str = typer.Option(DEFAULT_TENANT, help=TENANT_HELP),
    follow: bool = typer.Option(False, "--follow", help="Keep printing until the job ends."),
    output: Path | None = typer.Option(None, help="Write to this file instead of stdout."),
) -> None:
    """Print a job's results, one JSON object per line, from the tenant's RESULTS stream."""

    async def run(session: Session) -> int:
        tjs = session.tenant.jetstream()
        if session.mesh is not None and session.tenant_id is not None:
            await JobStore(session.mesh.jetstream()).get(session.tenant_id, job)
        else:
            try:
                await tjs.get_last_msg(EVENTS, events_subject(job))
            except NotFoundError:
                raise CrawlError(f"no job {job!r}: no events for it in this tenant's EVENTS")\
                    from None
        return await export_results(session.tenant, job, output, follow)

    count = run_session(active_settings(), creds, tenant, run)
    console.print(f"{count} results")
