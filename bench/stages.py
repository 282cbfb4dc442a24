"""Per-stage throughput: messages/s through each service's handler with the real broker.

One embedded mesh (as ``bench/run.py`` starts it: file storage, robots.txt on, tracing on
without an exporter, corpus politeness lifted) crawls the corpus. Once results flow, each
stage is measured in turn on the real messages of that crawl:

1. the stage's process is frozen (SIGSTOP) while the rest of the mesh keeps running, so
   its input stream fills with real inputs (up to ``--backlog`` messages, or until it
   stops growing);
2. every other service is frozen too, and the stage alone (with nats-server) is resumed
   (SIGCONT): the time it takes to drain its backlog gives messages/s, and its CPU (and
   nats-server's) over that time gives CPU ms per message;
3. the others are resumed and the crawl goes on; at the end the job must still complete
   with every page once (``--no-finish`` skips waiting for it).

Inputs: dedup ``LINKS`` (one ``DiscoveredLinks`` per page, ~55 links each), fetcher
``FRONTIER`` (one admitted URL, fetched from the corpus), parser ``FETCHED`` (one page),
sink ``PARSED`` + ``EXPANDED`` (one parsed page or expansion report). The stream sizes are
work-queue message counts (delivered but unacked messages included). The seeder (one
message per job) is not measured.

Reproduce::

    ../shared/corpus/serve start
    . .venv/bin/activate && PYTHONPATH=. python bench/stages.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nats.js import JetStreamContext

from bench.meter import TreeMeter, cpu_between
from bench.run import BODY_TEXT_RULE, seeds, service_pids, start_mesh, stop_mesh
from shared import subjects
from shared.cli.jobs import open_session, submit, wait_for_job
from shared.contracts import CrawlRequest, JobEventKind, Scope, ScopeMode
from shared.settings import MeshSettings

INPUTS: dict[str, tuple[str, ...]] = {
    "dedup": ("LINKS",),
    "fetcher": ("FRONTIER",),
    "parser": ("FETCHED",),
    "sink": ("PARSED", "EXPANDED"),
}
"""The input streams of each measured stage."""


@dataclass
class StageFigures:
    """One stage's drain."""

    stage: str
    messages: int
    seconds: float
    stage_cpu_s: float
    nats_cpu_s: float

    @property
    def per_s(self) -> float:
        return self.messages / self.seconds if self.seconds else 0.0

    def row(self) -> str:
        n = max(self.messages, 1)
        return (f"| {self.stage} | {self.messages:,} | {self.seconds:.2f} | {self.per_s:,.0f} | "
                f"{1000 * self.stage_cpu_s / n:.2f} | {1000 * self.nats_cpu_s / n:.2f} |")


async def backlog(js: JetStreamContext, stage: str) -> int:
    """Messages held in the stage's input streams."""
    total = 0
    for stream in INPUTS[stage]:
        total += (await js.stream_info(stream)).state.messages
    return total


def signal_all(pids: dict[str, int], roles: list[str], sig: signal.Signals) -> None:
    for role in roles:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[role], sig)


async def measure_stage(js: JetStreamContext, stage: str, pids: dict[str, int], meter: TreeMeter,
                        target: int, fill_timeout_s: float) -> StageFigures:
    """Freeze ``stage``, let its input fill, freeze the rest, time ``stage`` draining it."""
    others = [role for role in INPUTS if role != stage] + ["seeder"]
    os.kill(pids[stage], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + fill_timeout_s
        last, still_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            size = await backlog(js, stage)
            if size >= target:
                break
            if size != last:
                last, still_since = size, time.monotonic()
            elif time.monotonic() - still_since > 3.0:
                break
            await asyncio.sleep(0.2)
        signal_all(pids, others, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)  # publishes already sent land
            messages = await backlog(js, stage)
            before = meter.snapshot()
            started = time.monotonic()
            os.kill(pids[stage], signal.SIGCONT)
            left, progress_at = messages, started
            while left > 0 and time.monotonic() - progress_at < 5.0:
                await asyncio.sleep(0.02)
                now_left = await backlog(js, stage)
                if now_left < left:
                    progress_at = time.monotonic()
                left = now_left
            ended = progress_at if left else time.monotonic()
            after = meter.snapshot()
        finally:
            signal_all(pids, others, signal.SIGCONT)
    finally:
        os.kill(pids[stage], signal.SIGCONT)
    cpu = cpu_between(before, after)
    return StageFigures(stage, messages - left, ended - started, cpu.get(stage, 0.0),
                        cpu.get("nats-server", 0.0))


async def bench(settings: MeshSettings, pids: dict[str, int], meter: TreeMeter, stages: list[str],
                target: int, finish: bool, finish_timeout_s: float = 900) -> list[StageFigures]:
    """Submit the corpus crawl, measure each stage once results flow, then let it finish."""
    request = CrawlRequest(seeds=tuple(seeds()), job_id=subjects.new_job_id(), max_depth=100,
                           scope=Scope(mode=ScopeMode.SAME_HOST), rules=(BODY_TEXT_RULE,))
    figures: list[StageFigures] = []
    async with open_session(settings, None, "default") as session:
        assert session.mesh is not None
        js = session.mesh.jetstream()
        job = await submit(session.tenant, request, timeout_s=120)
        for stage in stages:
            await asyncio.sleep(5.0)  # the pipeline refills behind the previous stage
            figure = await measure_stage(js, stage, pids, meter, target, fill_timeout_s=60)
            print(figure.row(), flush=True)
            figures.append(figure)
        if finish:
            try:
                event = await asyncio.wait_for(wait_for_job(session.tenant, job, show=False),
                                               finish_timeout_s)
            except TimeoutError:
                counts = await session.counts(job)
                raise RuntimeError(
                    f"job {job} did not complete within {finish_timeout_s:.0f} s after the "
                    f"measurements: {counts.finished} of {counts.admitted} admitted pages "
                    f"finished, {counts.failed} failed (logs in {settings.home / 'logs'})"
                ) from None
            counters = event.counters
            print(f"job {job} {event.kind}: {counters.finished if counters else '?'} pages "
                  f"finished, {counters.failed if counters else '?'} failed", flush=True)
            if event.kind is not JobEventKind.COMPLETED:
                raise RuntimeError(f"job ended {event.kind}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlog", type=int, default=500, help="input messages to fill")
    parser.add_argument("--stages", default="fetcher,parser,dedup,sink")
    parser.add_argument("--no-finish", dest="finish", action="store_false",
                        help="stop the mesh after the measurements, without waiting for the job")
    parser.add_argument("--finish-timeout", type=float, default=900,
                        help="seconds to wait for the job to complete after the measurements")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s in INPUTS]
    work = Path(tempfile.mkdtemp(prefix="crawlmesh-stages-"))
    home = work / "home"
    home.mkdir()
    status = 0
    launcher, settings, _ = start_mesh(home)
    try:
        pids = service_pids(launcher.pid)
        meter = TreeMeter([launcher.pid]).start()
        print("| stage | messages | drain s | messages/s | stage CPU ms/msg | nats-server CPU ms/msg |")
        print("|---|---|---|---|---|---|", flush=True)
        try:
            asyncio.run(bench(settings, pids, meter, stages, args.backlog, args.finish,
                              args.finish_timeout))
        except RuntimeError as error:
            print(f"\n{error}", flush=True)
            status = 1
        finally:
            meter.stop()
    finally:
        stop_mesh(launcher)
    print(f"\nreproduce: PYTHONPATH=. python bench/stages.py {' '.join(sys.argv[1:])}".rstrip())
    return status


if __name__ == "__main__":
    sys.exit(main())
