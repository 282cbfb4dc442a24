"""CPU and memory of a process tree, sampled: what ``bench/run.py`` counts per crawler.

A :class:`TreeMeter` follows one or more root processes and every descendant (children
that start later included), every ``interval_s``: each process's cumulative CPU seconds
(user + system, as of its last sample, so a process that exits keeps what it had used up
to its last sample) and its resident set size (RSS, not USS). For live processes, the
peak RSS is also read from the kernel's high-water mark (``VmHWM`` of
``/proc/<pid>/status``) whenever :meth:`TreeMeter.snapshot` runs, which catches peaks
between samples.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil


def role_of(process: psutil.Process) -> str:
    """A readable role: ``nats-server``, ``launcher``, the service name, or the command."""
    try:
        args = process.cmdline()
        name = process.name()
    except psutil.Error:
        return "?"
    if "nats-server" in name:
        return "nats-server"
    if "service" in args and args[-1] != "service":
        return args[-1]
    if args[-1:] == ["up"] or "up" in args[-2:]:
        return "launcher"
    for arg in args:
        if arg.endswith(".py"):
            return Path(arg).stem
    return name


def peak_rss_bytes(pid: int) -> int:
    """The kernel's RSS high-water mark of ``pid`` (``VmHWM``), or 0 if unreadable."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class Sample:
    """What is known of one process."""

    pid: int
    role: str
    cpu_s: float = 0.0
    rss_peak_bytes: int = 0
    alive: bool = True


@dataclass
class TreeMeter:
    """Samples a process tree in a background thread (see module docstring)."""

    roots: list[int]
    interval_s: float = 0.2
    processes: dict[int, Sample] = field(default_factory=dict)
    total_rss_peak_bytes: int = 0
    _handles: dict[int, psutil.Process] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> TreeMeter:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="tree-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _tree(self) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for pid in self.roots:
            try:
                root = self._handles.get(pid) or psutil.Process(pid)
                found.append(root)
                found.extend(root.children(recursive=True))
            except psutil.Error:
                continue
        return found

    def sample(self, read_peaks: bool = False) -> None:
        """One sample of every process in the tree."""
        with self._lock:
            total_rss = 0
            seen: set[int] = set()
            for process in self._tree():
                handle = self._handles.setdefault(process.pid, process)
                try:
                    with handle.oneshot():
                        times = handle.cpu_times()
                        rss = handle.memory_info().rss
                except psutil.Error:
                    continue
                seen.add(handle.pid)
                record = self.processes.get(handle.pid)
                if record is None:
                    record = self.processes[handle.pid] = Sample(handle.pid, role_of(handle))
                record.cpu_s = times.user + times.system
                record.rss_peak_bytes = max(record.rss_peak_bytes, rss)
                if read_peaks:
                    record.rss_peak_bytes = max(record.rss_peak_bytes, peak_rss_bytes(handle.pid))
                total_rss += rss
            for pid, record in self.processes.items():
                record.alive = pid in seen
            self.total_rss_peak_bytes = max(self.total_rss_peak_bytes, total_rss)

    def snapshot(self) -> dict[int, Sample]:
        """A fresh sample (with kernel peaks), then a copy of every process's record."""
        self.sample(read_peaks=True)
        with self._lock:
            return {pid: Sample(s.pid, s.role, s.cpu_s, s.rss_peak_bytes, s.alive)
                    for pid, s in self.processes.items()}


def cpu_between(before: dict[int, Sample], after: dict[int, Sample]) -> dict[str, float]:
    """CPU seconds used between two snapshots, by role (processes started in between count
    from zero)."""
    used: dict[str, float] = {}
    for pid, sample in after.items():
        start = before[pid].cpu_s if pid in before else 0.0
        used[sample.role] = used.get(sample.role, 0.0) + sample.cpu_s - start
    return used


def rss_peaks(snapshot: dict[int, Sample]) -> dict[str, int]:
    """Peak RSS by role (the largest process of a role, when it has several)."""
    peaks: dict[str, int] = {}
    for sample in snapshot.values():
        peaks[sample.role] = max(peaks.get(sample.role, 0), sample.rss_peak_bytes)
    return peaks


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    """Poll ``predicate()`` until true. Raises TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s")
        time.sleep(interval_s)
