"""``crawlmesh dlq list|show|replay|purge``: dead letters an operator can act on.

Operator commands on the mesh host (a MESH connection, like ``status`` and ``cancel``).
Dead letters live in the ``DLQ`` stream on ``mesh.dlq.<stage>.<tenant>.<job>``
(:mod:`shared.bus.deadletter`); each is named by its id, ``<stream>:<sequence>`` of the
message that died. Filters combine: ``--stage``, ``--tenant`` (a name or id), ``--job``
(``-`` for seed submissions, which belong to no job yet) and, for replay and purge,
``--id`` (repeatable).

**Replay** republishes each selected dead letter's original payload to its original
subject with its original headers, a ``Nats-Msg-Id`` of ``<original id>:replay<N>`` (N:
the dead letter's DLQ sequence, so a replay is never swallowed by a duplicate window, and
replaying the same dead letter twice is de-duplicated by JetStream) and the replay headers
of :mod:`shared.bus.replays`. Once the PubAck comes, the dead letter is deleted from
``DLQ``; a replay that dies again is a new dead letter with a new id. What happens then:

* a page (dead in the fetcher, parser or sink: streams ``FRONTIER``, ``FETCHED``,
  ``PARSED``, or a result parked over quota, ``PARKED``) was finished as ``failed`` when
  it died, and its job may have completed since. Its replay re-runs the page from that
  stage and delivers **one additional result** for its URL, marked
  ``replay_of: <dead letter id>``, once whatever the redeliveries; the ``failed`` record
  stays. Its outlinks are not followed, and the job's counters, state and events do not
  change. Refused when the job was cancelled or is gone.
* links (``LINKS``, dedup) are admitted as usual, so the job must still be running;
  a seed submission (an intake stream) goes back to the seeder, which starts the job or
  answers ``rejected``.
* an expansion report (``EXPANDED``) is refused: the sink applied it when it recorded the
  dead letter, so a replay could change nothing. Dead letters of other streams are refused.

A dead letter the sink has not recorded yet (its ``failed`` record: see
:func:`shared.bus.dlqstore.recorded_up_to`) is neither replayed nor purged: wait a moment. **Purge** deletes
the selected dead letters after a confirmation (``--yes`` skips it; without a terminal it
is required).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import typer
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from rich.markup import escape

from shared import subjects
from shared.bus.dlqstore import NO_JOB_SHOWN, Selection, StoredLetter, job_token, read_letters
from shared.bus.replays import PAGE_STREAMS, REPLAY_HEADER, REPLAY_OF_HEADER, Replay, replay_msg_id
from shared.cli.jobs import CrawlError, active_settings, connect_or_explain, console
from shared.codec import MAGIC
from shared.contracts import DeadLetter, JobState
from shared.jobs import JobStore
from shared.streams import DLQ, StreamMissingError
from shared.subjects import Stage
from shared.tenancy import TenantError, TenantRegistry

T = TypeVar("T")
app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Dead letters: list, show, replay and purge them (on the mesh host).")

REASON_CHARS = 80
"""Characters of the reason shown by ``list`` (``show`` and ``--json`` give it whole)."""

DROPPED_HEADERS = ("Nats-Msg-Id", REPLAY_HEADER, REPLAY_OF_HEADER)
"""Original headers not republished as they were (a replay sets its own)."""


def decode_original(payload: bytes) -> tuple[str, Any]:
    """The original payload for display: ``("json", value)`` for JSON, ``("cmb1", {...})``
    for a binary envelope (:mod:`shared.codec`: its JSON plus ``binary_bytes``), ``("text",
    str)`` for other UTF-8 and ``("base64", str)`` for anything else."""
    if payload[:4] == MAGIC and len(payload) >= 8:
        size = int.from_bytes(payload[4:8], "big")
        try:
            meta = orjson.loads(payload[8:8 + size])
        except orjson.JSONDecodeError:
            meta = None
        if isinstance(meta, dict):
            return "cmb1", {**meta, "binary_bytes": len(payload) - 8 - size}
    try:
        return "json", orjson.loads(payload)
    except orjson.JSONDecodeError:
        pass
    try:
        return "text", payload.decode()
    except UnicodeDecodeError:
        return "base64", base64.b64encode(payload).decode()


def refusal(letter: DeadLetter, job: JobState | None, tenant_known: bool,
            recorded: bool) -> str | None:
    """Why ``letter`` is not replayed, or None (see the module docstring).

    Args:
        letter: the dead letter.
        job: its job's state now (None: no such job, or a seed submission).
        tenant_known: its tenant is registered.
        recorded: the sink has recorded the dead letter.
    """
    stream = letter.stream
    if not recorded:
        return "the sink has not recorded this dead letter yet: try again in a moment"
    if not tenant_known:
        return f"tenant {letter.tenant} is not registered (removed?)"
    if stream.startswith("INTAKE_"):
        return None
    if stream == "EXPANDED":
        return ("nothing to replay: the sink applied this expansion report when it recorded "
                "the dead letter")
    if stream not in (*PAGE_STREAMS, "LINKS"):
        return f"dead letters of stream {stream} are not replayable"
    if job is None:
        return f"job {letter.job_id} does not exist (any more)"
    if stream in PAGE_STREAMS:
        if job is JobState.CANCELLED:
            return f"job {letter.job_id} was cancelled: its tenant wants nothing more of it"
        return None
    if job is not JobState.RUNNING:
        return f"job {letter.job_id} is {job}: dedup admits links only for running jobs"
    return None


def replay_headers(stored: StoredLetter) -> dict[str, str]:
    """The headers of ``stored``'s replay: the original ones, a new ``Nats-Msg-Id`` and the
    replay headers (generation: the dead letter's ``DLQ`` sequence)."""
    letter = stored.letter
    original_id = letter.headers.get("Nats-Msg-Id") or f"{letter.stream}:{letter.stream_seq}"
    kept = {k: v for k, v in letter.headers.items() if k not in DROPPED_HEADERS
            and not k.startswith("Nats-Expected")}
    return {**kept, **Replay(stored.dlq_seq, letter.id).headers(),
            "Nats-Msg-Id": replay_msg_id(original_id, stored.dlq_seq)}


@dataclass
class Context:
    """A MESH connection with the tenant registry read once (``names``: id -> name)."""

    nc: Client
    js: JetStreamContext
    names: dict[str, str]

    def tenant_name(self, tenant_id: str) -> str:
        return self.names.get(tenant_id, tenant_id)


def run(work: Callable[[Context], Awaitable[T]]) -> T:
    """Run ``work`` with a MESH connection; errors are one red line and exit 1."""

    async def main() -> T:
        nc = await connect_or_explain(active_settings(), name="crawlmesh-cli-dlq")
        try:
            js = nc.jetstream()
            try:
                records = await TenantRegistry(js).records()
            except NotFoundError:
                records = []
            return await work(Context(nc, js, {r.id: r.name for r in records}))
        finally:
            await nc.close()

    try:
        return asyncio.run(main())
    except (CrawlError, StreamMissingError, TenantError, ValueError) as error:
        console.print(f"[red]{escape(str(error))}[/]")
        raise typer.Exit(1) from None


async def select(ctx: Context, stage: Stage | None, tenant: str | None, job: str | None,
                 ids: list[str] | None = None) -> list[StoredLetter]:
    """The dead letters matching the filters (``tenant``: a name or id).

    Raises:
        TenantError: unknown tenant.
        CrawlError: an ``--id`` matches no dead letter.
    """
    tenant_id = await TenantRegistry(ctx.js).resolve(tenant) if tenant else None
    selection = Selection(str(stage) if stage else None, tenant_id, job_token(job),
                          frozenset(ids or ()))
    found = await read_letters(ctx.js, selection)
    missing = selection.ids - {s.letter.id for s in found}
    if missing:
        filtered = " matching the filters" if (stage or tenant or job) else ""
        raise CrawlError(f"no dead letter {', '.join(sorted(missing))}{filtered} in {DLQ.name} "
                         "(replayed and purged ones are deleted)")
    return found


def letters(count: int) -> str:
    """``1 dead letter``, ``2 dead letters``."""
    return f"{count} dead letter{'' if count == 1 else 's'}"


def summary(ctx: Context, stored: StoredLetter) -> dict[str, Any]:
    """One dead letter as ``list --json`` prints it (no payload, no headers)."""
    letter = stored.letter
    return {
        "id": letter.id, "dlq_seq": stored.dlq_seq, "stage": letter.stage,
        "tenant": letter.tenant, "tenant_name": ctx.names.get(letter.tenant),
        "job_id": NO_JOB_SHOWN if letter.job_id == subjects.NO_JOB else letter.job_id,
        "delivery_count": letter.delivery_count, "dead_at": letter.dead_at.isoformat(),
        "reason": letter.reason, "subject": letter.subject, "stream": letter.stream,
        "stream_seq": letter.stream_seq, "recorded": stored.recorded,
    }


def line(ctx: Context, stored: StoredLetter) -> str:
    """One dead letter as ``list`` prints it."""
    s = summary(ctx, stored)
    reason = " ".join(s["reason"].split())
    if len(reason) > REASON_CHARS:
        reason = reason[:REASON_CHARS - 1] + "…"
    at = stored.letter.dead_at.strftime("%Y-%m-%dT%H:%M:%SZ")
    return (f"{s['id']}  stage={s['stage']} tenant={s['tenant_name'] or s['tenant']} "
            f"job={s['job_id']} deliveries={s['delivery_count']} at={at}  {reason}")


# ---- commands ---------------------------------------------------------------------------------

STAGE_HELP = "Only dead letters of this stage (the service that gave up)."
TENANT_HELP = "Only this tenant's (name or id)."
JOB_HELP = "Only this job's ('-': seed submissions, which have no job yet)."


@app.command("list")
def list_(
    stage: Stage | None = typer.Option(None, help=STAGE_HELP),
    tenant: str | None = typer.Option(None, help=TENANT_HELP),
    job: str | None = typer.Option(None, help=JOB_HELP),
    json_lines: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """List dead letters, oldest first: id, stage, tenant, job, deliveries, time, reason."""

    async def work(ctx: Context) -> int:
        found = await select(ctx, stage, tenant, job)
        for stored in found:
            typer.echo(orjson.dumps(summary(ctx, stored)).decode() if json_lines
                       else line(ctx, stored))
        return len(found)

    console.print(letters(run(work)))


@app.command(short_help="Show one dead letter whole, its original payload decoded.")
def show(dead_letter_id: str = typer.Argument(..., metavar="ID",
                                              help="Dead letter id (<stream>:<sequence>).")) -> None:
    """Show one dead letter whole: reason, headers and the original payload (decoded as
    JSON when it is JSON)."""

    async def work(ctx: Context) -> dict[str, Any]:
        stored = (await select(ctx, None, None, None, [dead_letter_id]))[-1]
        encoding, original = decode_original(stored.letter.original)
        return {**summary(ctx, stored), "headers": stored.letter.headers,
                "original_bytes": len(stored.letter.original),
                "original_encoding": encoding, "original": original}

    typer.echo(orjson.dumps(run(work), option=orjson.OPT_INDENT_2).decode())


@app.command(short_help="Republish dead letters to their stage (see its --help).")
def replay(
    stage: Stage | None = typer.Option(None, help=STAGE_HELP),
    tenant: str | None = typer.Option(None, help=TENANT_HELP),
    job: str | None = typer.Option(None, help=JOB_HELP),
    ids: list[str] | None = typer.Option(None, "--id", help="Only this dead letter (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be done; do nothing."),
) -> None:
    """Republish dead letters to their stage with their original headers and a new message
    id generation, deleting each from DLQ once its republish is acknowledged. A dead page
    (fetcher, parser or sink, or a parked result) is processed again and adds ONE MORE result for its URL,
    marked "replay_of" (its "failed" result stays); its outlinks are not followed and its
    job's counters, state and events do not change. Links (dedup) need a running job; seed
    submissions go back to the seeder. Expansion reports, and pages of
    cancelled jobs, are refused, saying why. Exits 1 if any is refused or gets no PubAck
    (that one is kept)."""

    async def work(ctx: Context) -> int:
        found = await select(ctx, stage, tenant, job, ids)
        jobs, refused = JobStore(ctx.js), 0
        for stored in found:
            letter = stored.letter
            state: JobState | None = None
            if letter.job_id != subjects.NO_JOB:
                record = await jobs.cached(letter.tenant, letter.job_id)
                state = record.state if record is not None else None
            why = refusal(letter, state, letter.tenant in ctx.names, stored.recorded)
            if why is not None:
                refused += 1
                typer.echo(f"refused {letter.id}: {why}")
                continue
            headers = replay_headers(stored)
            if dry_run:
                typer.echo(f"would replay {letter.id} to {letter.subject} as "
                           f"{headers['Nats-Msg-Id']}")
                continue
            try:
                ack = await ctx.js.publish(letter.subject, letter.original, headers=headers,
                                           timeout=10.0)
            except Exception as error:  # no PubAck: the dead letter stays
                refused += 1
                typer.echo(f"failed {letter.id}: no PubAck from {letter.subject} "
                           f"({type(error).__name__}: {error}); the dead letter is kept")
                continue
            with contextlib.suppress(NotFoundError):  # purged meanwhile
                await ctx.js.delete_msg(DLQ.name, stored.dlq_seq)
            note = " (already replayed: the stream held it as a duplicate)" if ack.duplicate \
                else f" ({ack.stream} seq {ack.seq})"
            typer.echo(f"replayed {letter.id} to {letter.subject} as "
                       f"{headers['Nats-Msg-Id']}{note}")
        console.print(f"{len(found) - refused} {'to replay' if dry_run else 'replayed'}, "
                      f"{refused} refused or failed")
        return refused

    raise typer.Exit(1 if run(work) else 0)


@app.command(short_help="Delete dead letters for good (asks first unless --yes).")
def purge(
    stage: Stage | None = typer.Option(None, help=STAGE_HELP),
    tenant: str | None = typer.Option(None, help=TENANT_HELP),
    job: str | None = typer.Option(None, help=JOB_HELP),
    ids: list[str] | None = typer.Option(None, "--id", help="Only this dead letter (repeatable)."),
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
) -> None:
    """Delete dead letters for good (asks first unless --yes). Dead letters the sink has
    not recorded yet are kept (their pages would never finish)."""

    async def work(ctx: Context) -> int:
        found = await select(ctx, stage, tenant, job, ids)
        waiting = [s for s in found if not s.recorded]
        chosen = [s for s in found if s.recorded]
        for stored in waiting:
            typer.echo(f"kept {stored.letter.id}: the sink has not recorded it yet")
        if not chosen:
            return 0
        if not yes:
            if not sys.stdin.isatty():
                raise CrawlError(f"not purging {letters(len(chosen))} without --yes "
                                 "(stdin is not a terminal to confirm)")
            if not typer.confirm(f"Delete {letters(len(chosen))} for good?"):
                raise CrawlError("nothing purged")
        for stored in chosen:
            try:
                await ctx.js.delete_msg(DLQ.name, stored.dlq_seq)
            except NotFoundError:
                pass
            typer.echo(f"purged {stored.letter.id}")
        return len(chosen)

    console.print(f"{letters(run(work))} purged")
