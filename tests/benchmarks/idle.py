"""Benchmark: what an idle embedded mesh costs, in percent of one core per process.

Starts ``crawlmesh up`` in a temporary home, lets it settle for 15 s, then samples the CPU
time of the launcher, nats-server and every service process over 30 s with no crawl.

Run::

    PYTHONPATH=. python tests/benchmarks/idle.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.sites import free_port

SETTLE_S, SAMPLE_S = 15.0, 30.0


def cpu_seconds(processes: list[psutil.Process]) -> dict[str, float]:
    """CPU seconds (user + system) so far, by service name (or process name)."""
    out: dict[str, float] = {}
    for process in processes:
        try:
            args = process.cmdline()
            times = process.cpu_times()
        except psutil.Error:
            continue
        name = args[-1] if "service" in args else process.name()
        out[name] = out.get(name, 0.0) + times.user + times.system
    return out


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="crawlmesh-idle-"))
    env = {**os.environ, "CRAWLMESH_HOME": str(home), "CRAWLMESH_METRICS_BASE_PORT": "0",
           "CRAWLMESH_NATS_URL": f"nats://127.0.0.1:{free_port()}"}
    mesh = subprocess.Popen([sys.executable, "-m", "shared.cli.main", "up"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (home / "mesh.json").exists():
            if mesh.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("crawlmesh up did not start")
            time.sleep(0.2)
        time.sleep(SETTLE_S)
        root = psutil.Process(mesh.pid)
        processes = [root, *root.children(recursive=True)]
        before = cpu_seconds(processes)
        time.sleep(SAMPLE_S)
        after = cpu_seconds(processes)
    finally:
        mesh.terminate()
        mesh.wait(60)
        shutil.rmtree(home, ignore_errors=True)
    print(f"idle embedded mesh, {SAMPLE_S:.0f} s sample, {os.cpu_count()} cores; % of one core:")
    for name in sorted(after):
        print(f"  {name:<12} {100 * (after[name] - before.get(name, 0.0)) / SAMPLE_S:5.1f}")
    total = sum(after[n] - before.get(n, 0.0) for n in after)
    print(f"  {'total':<12} {100 * total / SAMPLE_S:5.1f}")
    print("reproduce: PYTHONPATH=. python tests/benchmarks/idle.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
