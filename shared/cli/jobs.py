"""``crawlmesh crawl``, ``status``, ``cancel``, ``results``: a tenant's view of its jobs."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import nats
import orjson
import typer
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from shared import subjects
from shared.bus.connection import connect
from shared.cli.progress import JobProgress
from shared.codec import decode, describe, encode
from shared.contracts import (
    CrawlRequest,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    Scope,
    ScopeMode,
    SeedReply,
)
from shared.jobs import JobNotFoundError, JobStore, job_key, ledger_counts
from shared.settings import MeshSettings
from shared.streams import JOBS_BUCKET, events_stream, results_stream
from shared.tenancy import DEFAULT_TENANT, TenantError, TenantRegistry

console = Console(stderr=True)
T = TypeVar("T")


class CrawlError(RuntimeError):
    """The crawl was rejected or the mesh is unreachable; the message says why."""


async def submit(nc: Client, tenant_id: str, request: CrawlRequest, timeout_s: float = 30) -> str:
    """Publish ``request`` on the tenant's intake subject and wait for the seeder's answer.

    Returns the job id.

    Raises:
        CrawlError: rejected (with the seeder's reason) or no answer within ``timeout_s``.
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    request = request.model_copy(update={"reply_to": inbox,
                                         "job_id": request.job_id or subjects.new_job_id()})
    await nc.jetstream().publish(subjects.seeds(tenant_id), encode(request))
    try:
        msg = await sub.next_msg(timeout=timeout_s)
    except (NatsTimeoutError, TimeoutError):
        raise CrawlError(f"no answer from the seeder within {timeout_s:.0f}s "
                         "(is the mesh running? `crawlmesh up`)") from None
    reply = decode(msg.data, SeedReply)
    if not reply.accepted or reply.job_id is None:
        raise CrawlError(f"crawl rejected: {reply.reason}")
    return reply.job_id


async def wait_for_job(nc: Client, settings: MeshSettings, tenant_id: str, job: str,
                       show: bool) -> JobEvent:
    """Follow the job's events until it completes or is cancelled, showing progress
    (:class:`shared.cli.progress.JobProgress`: a bar on a terminal, lines otherwise).

    Returns the final event (``completed`` or ``cancelled``).
    """
    js = nc.jetstream()
    sub = await js.subscribe(
        subjects.events(tenant_id, job), stream=events_stream(tenant_id, settings).name,
        ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
    )
    budget = None
    with contextlib.suppress(JobNotFoundError):
        budget = (await JobStore(js).get(tenant_id, job))[0].request.max_pages
    with JobProgress.for_console(job, console, show, budget) as progress:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except (NatsTimeoutError, TimeoutError):
                progress.update(await ledger_counts(js, tenant_id, job))
                continue
            event = decode(msg.data, JobEvent)
            if event.kind in (JobEventKind.COMPLETED, JobEventKind.CANCELLED):
                progress.update(event.counters, final=True)
                await sub.unsubscribe()
                return event


async def export_results(nc: Client, settings: MeshSettings, tenant_id: str, job: str,
                         output: Path | None, follow: bool = False) -> int:
    """Write the job's results as JSON lines to ``output`` (stdout when None).

    With ``follow``, keep printing new results until the job is no longer running.
    Returns how many results were written.
    """
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        subjects.results(tenant_id, job), durable=None,
        stream=results_stream(tenant_id, settings).name,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy="none",
                              inactive_threshold=60.0, max_ack_pending=-1),
    )
    handle = output.open("wb") if output else sys.stdout.buffer
    count = 0
    jobs = JobStore(js)
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
            if not follow:
                info = await sub.consumer_info()
                if info.num_pending == 0:
                    break
            else:
                record = await jobs.cached(tenant_id, job)
                if record is None or record.state is not JobState.RUNNING:
                    follow = False
        handle.flush()
    finally:
        if output:
            handle.close()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return count


async def _tenant_id(nc: Client, tenant: str) -> str:
    try:
        return await TenantRegistry(nc.jetstream()).resolve(tenant)
    except TenantError as error:
        raise CrawlError(str(error)) from None


async def _connect_or_explain(settings: MeshSettings) -> Client:
    try:
        return await connect(settings, name="crawlmesh-cli", persistent=False)
    except (nats.errors.NoServersError, OSError) as error:
        raise CrawlError(f"cannot reach NATS at {settings.nats_url}: {error} "
                         "(start the mesh with `crawlmesh up`)") from None


async def run_crawl(settings: MeshSettings, tenant: str, request: CrawlRequest, wait: bool,
                    output: Path | None) -> int:
    """Submit, optionally wait and export. Returns the process exit status."""
    nc = await _connect_or_explain(settings)
    try:
        tenant_id = await _tenant_id(nc, tenant)
        started = time.monotonic()
        job = await submit(nc, tenant_id, request)
        console.print(f"job [bold]{job}[/] accepted")
        if not wait:
            typer.echo(job)
            return 0
        main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stop like Ctrl-C does
            loop.add_signal_handler(sig, main.cancel if main else lambda: None)
        try:
            event = await wait_for_job(nc, settings, tenant_id, job, show=True)
        except asyncio.CancelledError:  # interrupted: stop the crawl, not just the waiting
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    if await cancel_job(nc.jetstream(), tenant_id, job, "interrupted"):
                        console.print(f"interrupted: job {job} cancelled")
            raise
        elapsed = time.monotonic() - started
        c = event.counters
        console.print(f"job {job} {event.kind}: {c.finished} pages finished "
                      f"({c.failed} failed) of {c.admitted} admitted in {elapsed:.1f}s")
        if output is not None:
            count = await export_results(nc, settings, tenant_id, job, output)
            console.print(f"{count} results written to {output}")
        typer.echo(job)
        return 0 if event.kind is JobEventKind.COMPLETED else 1
    finally:
        await nc.close()


def crawl(
    seeds: list[str] = typer.Argument(..., help="Seed URLs (http/https)."),
    tenant: str = typer.Option(DEFAULT_TENANT, help="Tenant name or id."),
    max_pages: int = typer.Option(10_000, help="Most pages admitted for the job."),
    max_depth: int = typer.Option(3, help="Most link hops from a seed."),
    max_pages_per_host: int = typer.Option(0, help="Most pages per host (0: no cap)."),
    scope: ScopeMode = typer.Option(ScopeMode.SAME_HOST, help="Which links to follow."),
    wait: bool = typer.Option(False, "--wait", help="Show progress and exit when complete."),
    output: Path | None = typer.Option(None, help="With --wait: write results (JSON lines)."),
    embedded: bool = typer.Option(True, help="Start the embedded mesh if none is running."),
) -> None:
    """Submit a crawl of SEEDS (prints the job id); with --wait, follow it to completion."""
    from shared.cli.mesh import ensure_mesh_running, mesh_available

    try:
        request = CrawlRequest(seeds=tuple(seeds), max_pages=max_pages, max_depth=max_depth,
                               max_pages_per_host=max_pages_per_host, scope=Scope(mode=scope))
    except ValidationError as error:
        console.print(f"[red]{escape(describe(error, 'crawl request'))}[/]")
        raise typer.Exit(2) from None
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
        except CrawlError as error:
            console.print(f"[red]{escape(str(error))}[/]")
            raise typer.Exit(1) from None
    raise typer.Exit(status)


async def cancel_job(js: JetStreamContext, tenant_id: str, job: str, reason: str) -> bool:
    """Move a running job to cancelled and publish its ``cancelled`` event.

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


def active_settings() -> MeshSettings:
    """Settings pointing at the mesh `crawlmesh up` runs from the home folder, if any."""
    from shared.launcher import running_mesh

    settings = MeshSettings()
    state = running_mesh(settings.home)
    return settings.model_copy(update={"nats_url": str(state["url"])}) if state else settings


def as_tenant(tenant: str, work: Callable[[Client, MeshSettings, str], Awaitable[T]]) -> T:
    """Connect, resolve ``tenant``, run ``work(nc, settings, tenant_id)``, close.

    Raises:
        typer.Exit: status 1 after printing the reason, when the mesh is unreachable, the
            tenant or the job unknown.
    """

    async def run() -> T:
        settings = active_settings()
        nc = await _connect_or_explain(settings)
        try:
            return await work(nc, settings, await _tenant_id(nc, tenant))
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except JobNotFoundError as error:
        console.print(f"[red]no job {escape(repr(error.args[1]))} for tenant "
                      f"{escape(repr(tenant))}[/]" if len(error.args) > 1 else str(error))
        raise typer.Exit(1) from None
    except CrawlError as error:
        console.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(1) from None


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


def status(
    job: str | None = typer.Argument(None, help="Job id (all jobs when omitted)."),
    tenant: str = typer.Option(DEFAULT_TENANT, help="Tenant name or id."),
    follow: bool = typer.Option(False, "--follow",
                                help="Show the job's progress until it ends, then its status."),
) -> None:
    """Show a job's state and counters, or list the tenant's jobs (JSON lines)."""
    if follow and job is None:
        raise typer.BadParameter("needs a JOB", param_hint="--follow")

    async def show(nc: Client, settings: MeshSettings, tenant_id: str) -> None:
        js = nc.jetstream()
        store = JobStore(js)
        records = [(await store.get(tenant_id, job))[0]] if job else await store.all(tenant_id)
        if follow and job and records[0].state is JobState.RUNNING:
            await wait_for_job(nc, settings, tenant_id, job, show=True)
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
        as_tenant(tenant, show)
    except KeyboardInterrupt:  # stop watching; the job goes on
        raise typer.Exit(130) from None


def cancel(
    job: str = typer.Argument(..., help="Job id."),
    tenant: str = typer.Option(DEFAULT_TENANT, help="Tenant name or id."),
) -> None:
    """Cancel a running job: nothing more is admitted or fetched for it."""

    async def run(nc: Client, settings: MeshSettings, tenant_id: str) -> bool:
        return await cancel_job(nc.jetstream(), tenant_id, job, "cancelled by request")

    changed = as_tenant(tenant, run)
    console.print(f"job {job} cancelled" if changed else f"job {job} was not running")


def results(
    job: str = typer.Argument(..., help="Job id."),
    tenant: str = typer.Option(DEFAULT_TENANT, help="Tenant name or id."),
    follow: bool = typer.Option(False, "--follow", help="Keep printing until the job ends."),
    output: Path | None = typer.Option(None, help="Write to this file instead of stdout."),
) -> None:
    """Print a job's results, one JSON object per line, from the tenant's RESULTS stream."""

    async def run(nc: Client, settings: MeshSettings, tenant_id: str) -> int:
        await JobStore(nc.jetstream()).get(tenant_id, job)  # unknown job: a clear error
        return await export_results(nc, settings, tenant_id, job, output, follow)

    count = as_tenant(tenant, run)
    console.print(f"{count} results")
