"""Where the CPU goes: a summary of py-spy's raw (collapsed) stacks, per process.

``bench/run.py --profile DIR`` leaves one ``DIR/<service>.txt`` per service process,
written by ``py-spy record --format raw --rate 100`` (idle threads are not sampled, so
every sample is a thread on the CPU or holding the GIL). Each line is
``frame;frame;...;leaf count``, a frame being ``function (file:line)``. This prints, per
process, the samples (and seconds at the sampling rate), the functions with the most
*self* samples (the leaf frame) and the most *inclusive* samples (anywhere on the stack,
counted once per stack), as percentages of that process's samples::

    python bench/profile_summary.py DIR [--top 15] [--rate 100]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^():]*)(?::\d+)?\)$")
SITE_PACKAGES = re.compile(r".*/(site-packages|lib/python3\.\d+)/")
REPO = re.compile(r".*/main/")


def short_frame(frame: str) -> str:
    """``function (file)`` with the file shortened to its package path, line dropped."""
    match = FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = SITE_PACKAGES.sub("", match["file"])
    path = REPO.sub("", path)
    return f"{match['function']} ({path})"


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    """Stacks (root first) and their sample counts from one raw py-spy file."""
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = tuple(short_frame(f) for f in stack.split(";") if f)
        stacks[frames] += int(count)
    return stacks


def summarise(stacks: Counter[tuple[str, ...]]) -> tuple[int, Counter[str], Counter[str]]:
    """Total samples, self samples by function, inclusive samples by function."""
    total = sum(stacks.values())
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks.items():
        if not frames:
            continue
        leaf[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    return total, leaf, inclusive


def report(path: Path, top: int, rate: float) -> str:
    """The Markdown summary of one process's profile."""
    total, leaf, inclusive = summarise(read_stacks(path))
    lines = [f"### {path.stem}: {total:,} samples (~{total / rate:.1f} CPU s at {rate:.0f} Hz)", ""]
    if not total:
        return "\n".join(lines)
    lines += ["| self % | function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in leaf.most_common(top)]
    lines += ["", "| inclusive % | function |", "|---|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate")
    args = parser.parse_args(argv)
    for path in sorted(args.folder.glob("*.txt")):
        print(report(path, args.top, args.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
