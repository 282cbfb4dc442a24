"""``crawlmesh tenant …``: tenant administration at run time (operator, on the mesh host).

Every command goes through :class:`shared.accounts.control.TenantControl` (MESH and SYS
creds from the home folder, the control lock held): account JWTs are re-issued and pushed
to the running nats-server, never restarted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import nats
import orjson
import typer
from pydantic import ByteSize, TypeAdapter, ValidationError
from rich.console import Console
from rich.markup import escape

from shared.accounts.claims import TenantQuota
from shared.accounts.control import TenantControl
from shared.accounts.jwt import JwtError
from shared.accounts.keystore import KeyStore
from shared.accounts.resolver import ClaimsError
from shared.cli.jobs import active_settings
from shared.tenancy import TenantError, TenantRecord

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Tenant administration (accounts, quotas, creds) at run time.")
console = Console(stderr=True, soft_wrap=True)  # one message, one line (logs, grep)
T = TypeVar("T")
_SIZE = TypeAdapter(ByteSize)


def parse_size(value: str | None) -> int | None:
    """Bytes of ``1GiB``, ``500MiB``, ``2GB`` or ``123`` (None stays None).

    Raises:
        typer.BadParameter: not a size.
    """
    if value is None:
        return None
    try:
        return int(_SIZE.validate_python(value))
    except ValidationError:
        raise typer.BadParameter(f"not a size: {value!r} (e.g. 1GiB, 500MiB, 123)",
                                 param_hint="--storage") from None


def human(size: int) -> str:
    return ByteSize(size).human_readable() if size >= 0 else "unlimited"


def _control(work: Callable[[TenantControl], Awaitable[T]]) -> T:
    """Run ``work`` with the control plane of the running mesh; print errors, exit 1."""
    settings = active_settings()

    async def run() -> T:
        async with TenantControl.open(settings) as control:
            return await work(control)

    try:
        return asyncio.run(run())
    except (nats.errors.NoServersError, OSError) as error:
        _fail(f"cannot reach NATS at {settings.nats_url}: {error} "
              "(start the mesh with `crawlmesh up`)")
    except (TenantError, JwtError, ClaimsError) as error:
        _fail(str(error))
    raise AssertionError("unreachable")


def _fail(message: str) -> None:
    console.print(f"[red]{escape(message)}[/]")
    raise typer.Exit(1)


def _quota_fields(storage: str | None, max_streams: int | None, max_consumers: int | None,
                  max_pages_per_job: int | None,
                  max_concurrent_jobs: int | None) -> dict[str, int]:
    fields = {"storage_bytes": parse_size(storage), "max_streams": max_streams,
              "max_consumers": max_consumers, "max_pages_per_job": max_pages_per_job,
              "max_concurrent_jobs": max_concurrent_jobs}
    return {k: v for k, v in fields.items() if v is not None}


def _check_quota(quota: dict[str, Any]) -> TenantQuota:
    try:
        return TenantQuota(**quota)
    except ValidationError as error:
        message = "; ".join(f"--{'-'.join(str(p) for p in e['loc']).replace('_', '-')}: "
                            f"{e['msg']}" for e in error.errors())
        raise typer.BadParameter(message) from None


def _quota_lines(quota: TenantQuota) -> list[str]:
    return [f"  storage:             {human(quota.storage_bytes)} ({quota.storage_bytes} bytes)",
            f"  max streams:         {quota.max_streams}",
            f"  max consumers:       {quota.max_consumers}",
            f"  max pages per job:   {quota.max_pages_per_job}",
            f"  max concurrent jobs: {quota.max_concurrent_jobs}"]


def _echo_record(record: TenantRecord) -> None:
    typer.echo(f"tenant {record.name}: {record.id} ({record.status})")
    for line in _quota_lines(record.quota):
        typer.echo(line)


StorageOpt = typer.Option(None, "--storage", help="JetStream storage quota: 1GiB, 500MiB, 123…")
StreamsOpt = typer.Option(None, "--max-streams", help="Streams the account may hold (>= 2).")
ConsumersOpt = typer.Option(None, "--max-consumers", help="Consumers each stream may have.")
PagesOpt = typer.Option(None, "--max-pages-per-job", help="Largest max_pages of a submission.")
JobsOpt = typer.Option(None, "--max-concurrent-jobs", help="Jobs running at once.")


@app.command()
def add(
    name: str = typer.Argument(..., help="Tenant name: lowercase letters, digits, - and _."),
    storage: str | None = StorageOpt,
    max_streams: int | None = StreamsOpt,
    max_consumers: int | None = ConsumersOpt,
    max_pages_per_job: int | None = PagesOpt,
    max_concurrent_jobs: int | None = JobsOpt,
) -> None:
    """Create a tenant: its NATS account, RESULTS and EVENTS streams, and a user creds file."""
    quota = _check_quota(_quota_fields(storage, max_streams, max_consumers, max_pages_per_job,
                                       max_concurrent_jobs))

    async def run(control: TenantControl) -> tuple[TenantRecord, Path]:
        record = await control.add(name, quota)
        return record, control.keys.tenant_creds(record.name)

    record, creds = _control(run)
    _echo_record(record)
    typer.echo(f"creds: {creds}")


@app.command("list")
def list_() -> None:
    """List tenants: name, id, status, storage quota."""

    async def run(control: TenantControl) -> list[TenantRecord]:
        return await control.registry.records()

    records = _control(run)
    typer.echo(f"{'NAME':<20} {'STATUS':<10} {'STORAGE':>10}  ID")
    for record in records:
        typer.echo(f"{record.name:<20} {record.status.value:<10} "
                   f"{human(record.quota.storage_bytes):>10}  {record.id}")


@app.command()
def show(
    name: str = typer.Argument(..., help="Tenant name or id."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of text."),
) -> None:
    """Show a tenant's quota and what it uses (storage, streams, consumers, messages)."""

    async def run(control: TenantControl) -> tuple[TenantRecord, dict[str, Any]]:
        return await control.registry.get(name), await control.usage(name)

    record, usage = _control(run)
    creds = KeyStore(active_settings().home).tenant_creds(record.name)
    if as_json:
        typer.echo(orjson.dumps({**record.model_dump(mode="json"), "usage": usage,
                                 "creds": str(creds) if creds.exists() else None}).decode())
        return
    _echo_record(record)
    used, limit = usage["storage_used_bytes"], usage["storage_limit_bytes"]
    share = f" ({100 * used / limit:.1f}%)" if limit > 0 else ""
    typer.echo("use:")
    typer.echo(f"  storage:   {human(used)} of {human(limit)}{share}")
    typer.echo(f"  streams:   {usage['streams']} of {record.quota.max_streams}")
    typer.echo(f"  consumers: {usage['consumers']} of {record.quota.max_consumers}")
    for stream in ("RESULTS", "EVENTS"):
        state = usage.get(stream)
        typer.echo(f"  {stream}: " + (f"{state['messages']} messages, {human(state['bytes'])}"
                                      if state else "missing (deleted by the tenant?)"))
    typer.echo(f"creds: {creds if creds.exists() else '(none on this host)'}")


@app.command()
def update(
    name: str = typer.Argument(..., help="Tenant name or id."),
    storage: str | None = StorageOpt,
    max_streams: int | None = StreamsOpt,
    max_consumers: int | None = ConsumersOpt,
    max_pages_per_job: int | None = PagesOpt,
    max_concurrent_jobs: int | None = JobsOpt,
) -> None:
    """Change a tenant's quota live. Lowering below current use is allowed: new writes are
    refused (pages parked, admission paused) until use falls."""
    changes = _quota_fields(storage, max_streams, max_consumers, max_pages_per_job,
                            max_concurrent_jobs)
    if not changes:
        raise typer.BadParameter("nothing to change: give at least one quota option")
    _check_quota(changes)

    async def run(control: TenantControl) -> TenantRecord:
        return await control.update(name, **changes)

    _echo_record(_control(run))


@app.command()
def suspend(name: str = typer.Argument(..., help="Tenant name or id.")) -> None:
    """Revoke the tenant's users (connections closed, creds refused) and pause its jobs."""
    record = _control(lambda control: control.suspend(name))
    typer.echo(f"tenant {record.name} suspended: its users are revoked, its jobs paused")


@app.command()
def resume(name: str = typer.Argument(..., help="Tenant name or id.")) -> None:
    """Lift a suspension: the tenant's creds work again and its jobs go on."""
    record = _control(lambda control: control.resume(name))
    typer.echo(f"tenant {record.name} resumed")


@app.command()
def remove(
    name: str = typer.Argument(..., help="Tenant name or id."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete a tenant: cancel its jobs, delete its streams, KV keys, objects, dead letters
    and parked pages, then its account (its creds stop working)."""
    if not yes and not typer.confirm(f"remove tenant {name} and all its data?", default=False):
        console.print("not removed (confirm with --yes)")
        raise typer.Exit(1)
    record = _control(lambda control: control.remove(name))
    typer.echo(f"tenant {record.name} removed ({record.id})")


@app.command("rotate-creds")
def rotate_creds(
    name: str = typer.Argument(..., help="Tenant name or id."),
    output: Path | None = typer.Option(None, "--output", "-o",
                                       help="Also write the new creds file here (the home "
                                            "folder's creds/tenants/NAME.creds is always "
                                            "replaced)."),
) -> None:
    """Issue the tenant user a new creds file; every earlier user of the tenant is revoked."""
    path = _control(lambda control: control.rotate_creds(name, output))
    typer.echo(f"new creds for tenant {name}: {path} (earlier creds are revoked)")

