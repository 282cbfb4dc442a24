"""``crawlmesh crawl``, ``results``: submitting crawls and reading a tenant's results."""

from __future__ import annotations

import asyncio

import orjson
import typer
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from rich.console import Console

from shared import subjects
from shared.bus.connection import connect
from shared.codec import encode
from shared.contracts import CrawlRequest
from shared.settings import MeshSettings
from shared.streams import results_stream
from shared.tenancy import DEFAULT_TENANT, TenantRegistry

console = Console(stderr=True)


async def submit(settings: MeshSettings, tenant: str, request: CrawlRequest) -> str:
    """Publish ``request`` on the tenant's intake subject; return the job id.

    Raises:
        shared.tenancy.TenantError: unknown tenant.
    """
    nc = await connect(settings, name="crawlmesh-cli")
    try:
        js = nc.jetstream()
        tenant_id = await TenantRegistry(js).resolve(tenant)
        job = request.job_id or subjects.new_job_id()
        request = request.model_copy(update={"job_id": job})
        await js.publish(subjects.seeds(tenant_id), encode(request))
        return job
    finally:
        await nc.close()


def crawl(
    seeds: list[str] = typer.Argument(..., help="Seed URLs (http/https)."),
    tenant: str = typer.Option(DEFAULT_TENANT, help="Tenant name or id."),
    max_pages: int = typer.Option(10_000, help="Most pages admitted for the job."),
    max_depth: int = typer.Option(3, help="Most link hops from a seed."),
) -> None:
    """Submit a crawl of SEEDS and print its job id."""
    try:
        request = CrawlRequest(seeds=tuple(seeds), max_pages=max_pages, max_depth=max_depth)
    except ValueError as error:
        console.print(f"[red]invalid crawl request:[/] {error}")
        raise typer.Exit(2) from None
    job = asyncio.run(submit(MeshSettings(), tenant, request))
    typer.echo(job)


async def read_results(settings: MeshSettings, tenant: str, job: str, wait_s: float) -> int:
    """Print every result of ``job`` as a JSON line; return how many were printed."""
    nc = await connect(settings, name="crawlmesh-results")
    count = 0
    try:
        js = nc.jetstream()
        tenant_id = await TenantRegistry(js).resolve(tenant)
        stream = results_stream(tenant_id, settings).name
        sub = await js.pull_subscribe(
            subjects.results(tenant_id, job), durable=None, stream=stream,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy="none",
                                  inactive_threshold=30.0),
        )
        while True:
            try:
                msgs = await sub.fetch(256, timeout=wait_s)
            except (NatsTimeoutError, TimeoutError):
                break
            for msg in msgs:
                typer.echo(orjson.loads(msg.data) and msg.data.decode())
                count += 1
        return count
    finally:
        await nc.close()


def results(
    job: str = typer.Argument(..., help="Job id."),
    tenant: str = typer.Option(DEFAULT_TENANT, help="Tenant name or id."),
    wait: float = typer.Option(2.0, help="Stop after this many seconds without a new result."),
) -> None:
    """Print a job's results (one JSON object per line) from the tenant's RESULTS stream."""
    count = asyncio.run(read_results(MeshSettings(), tenant, job, wait))
    console.print(f"{count} results")
