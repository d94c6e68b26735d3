"""One thread's profile from py-spy's raw samples: where a serving process's serving thread spends its time.

``serve_load.py --profile-serving`` records the serving process for each measured window with py-spy
(``record --format raw --threads --idle``: every thread's stack, waiting ones included, ``--nonblocking``
so the process is never paused) and prints the serving thread's functions by inclusive share (the
samples with the function anywhere on the stack) and own share (the samples where it is the innermost
frame; C code shows as its Python caller). py-spy is a tool of its own (``pip install py-spy``); on
Linux it needs ptrace rights over the process (root, or ``kernel.yama.ptrace_scope`` 0).

    python benchmarks/thread_profile.py RAW_FILE [--thread dflash-trt-serving] [--top 15]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

SERVING_THREAD = "dflash-trt-serving"  # ServingLoop's thread (runtime/serving/loop.py)
_LINE = re.compile(r" \(([^():]*?):\d+\)$")  # a frame's " (file:line)"


def frame_name(frame: str) -> str:
    """``func (path/file.py:123)`` -> ``func (file.py)``: samples of one function at any line add up.

    >>> frame_name("Executor._read_cycle (runtime/executor.py:680)")
    'Executor._read_cycle (executor.py)'
    """
    found = _LINE.search(frame)
    return frame if found is None else f"{frame[: found.start()]} ({Path(found.group(1)).name})"


def profile(raw: str, thread: str = SERVING_THREAD, top: int = 40) -> dict:
    """py-spy raw samples (``thread (TID): NAME;frame;...;frame COUNT`` a line, with ``--threads``) -> the
    samples of the threads named ``thread``, and its ``top`` functions by inclusive and by own share (%).

    >>> raw = "thread (7): dflash-trt-serving;run (a.py:1);read (b.py:2) 3\\nthread (7): dflash-trt-serving;run (a.py:1) 1\\n"
    >>> p = profile(raw + "thread (8): other;x (c.py:1) 5\\n", top=2)
    >>> p["samples"], p["inclusive"], p["own"]
    (4, [['run (a.py)', 100.0], ['read (b.py)', 75.0]], [['read (b.py)', 75.0], ['run (a.py)', 25.0]])
    """
    inclusive: Counter = Counter()
    own: Counter = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or len(frames) < 2 or frames[0].split(": ", 1)[-1] != thread:
            continue
        n = int(count)
        samples += n
        names = [frame_name(frame) for frame in frames[1:]]
        own[names[-1]] += n
        for name in set(names):
            inclusive[name] += n

    def shares(counter: Counter) -> list[list]:
        return [[name, round(100.0 * n / samples, 1)] for name, n in counter.most_common(top)] if samples else []

    return {"thread": thread, "samples": samples, "inclusive": shares(inclusive), "own": shares(own)}


def record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen:
    """Start py-spy sampling process ``pid`` for ``seconds`` into ``out`` (raw); returns the py-spy process."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile-serving needs py-spy on PATH (pip install py-spy)")
    command = [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
               "--format", "raw", "--threads", "--idle", "--nonblocking", "--output", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(spy: subprocess.Popen, out: Path, top: int) -> dict:
    """Wait for ``record``'s py-spy and read its samples; a py-spy failure is reported, not raised."""
    _, errors = spy.communicate(timeout=120)
    if spy.returncode != 0 or not out.exists():
        return {"error": (errors or "").strip().splitlines()[-1:] or [f"py-spy exited {spy.returncode}"]}
    return profile(out.read_text(), top=top)


def table(result: dict, rows: int = 15) -> str:
    """The profile as a markdown table: functions by inclusive share (the frames on every sample, the
    thread's own entry chain, left out), each with its own share; then the largest own shares."""
    if "error" in result:
        return f"thread profile: py-spy failed: {result['error']}"
    own = dict(map(tuple, result["own"]))
    lines = [f"{result['thread']} thread, {result['samples']} py-spy samples:", "| function | inclusive % | own % |", "| --- | --- | --- |"]
    lines += [f"| {name} | {share} | {own.get(name, '')} |" for name, share in [r for r in result["inclusive"] if r[1] < 99.0][:rows]]
    lines.append("own: " + "; ".join(f"{name} {share}%" for name, share in result["own"][:8]))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="py-spy record --format raw --threads output")
    parser.add_argument("--thread", default=SERVING_THREAD)
    parser.add_argument("--top", type=int, default=15, help="rows of the inclusive table")
    args = parser.parse_args()
    print(table(profile(args.raw.read_text(), args.thread), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
