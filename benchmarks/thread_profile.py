"""One thread's profile from py-spy's raw samples: where a serving process's serving thread spends its time.

``serve_load.py --profile-serving`` records the serving process for each measured window with py-spy
(``record --format raw --threads --idle``: every thread's stack, waiting ones included, ``--nonblocking``
so the process is never paused) and prints the serving thread's functions by inclusive share (the
samples with the function anywhere on the stack) and own share (the samples where it is the innermost
frame; C code shows as its Python caller). ``--profile-serving gil`` samples only the thread holding the
GIL (``--gil``) and prints each thread's share of it and the functions over all threads: where a process
whose threads share one GIL spends it. py-spy is a tool of its own (``pip install py-spy``); on
Linux it needs ptrace rights over the process (root, or ``kernel.yama.ptrace_scope`` 0).

    python benchmarks/thread_profile.py RAW_FILE [--thread dflash-trt-serving | --gil] [--top 15]
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
    result = _shares(raw, top, thread)
    del result["threads"]  # one thread: its share is all of them
    return {"thread": thread} | result


def gil_profile(raw: str, top: int = 40) -> dict:
    """py-spy raw samples taken with ``--gil`` (only the thread holding the GIL, at each sample) -> who holds
    the process's GIL: each thread's share of the samples, and the ``top`` functions by inclusive and own
    share over every thread (a process whose threads share one GIL is bound by their sum, not by one thread).

    >>> raw = "thread (7): dflash-trt-serving;run (a.py:1);read (b.py:2) 3\\nthread (8): sender;send (c.py:1) 1\\n"
    >>> p = gil_profile(raw, top=2)
    >>> p["samples"], p["threads"], p["own"]
    (4, [['dflash-trt-serving', 75.0], ['sender', 25.0]], [['read (b.py)', 75.0], ['send (c.py)', 25.0]])
    """
    return _shares(raw, top) | {"thread": "GIL holder"}


def _shares(raw: str, top: int, thread: str | None = None) -> dict:
    """One pass over the samples of the threads named ``thread`` (None: every thread): their count, and the
    ``top`` threads, functions by inclusive share and functions by own share (%)."""
    threads: Counter = Counter()
    inclusive: Counter = Counter()
    own: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        if not count.isdigit() or len(frames) < 2 or thread not in (None, name):
            continue
        n = int(count)
        threads[name] += n
        names = [frame_name(frame) for frame in frames[1:]]
        own[names[-1]] += n
        for function in set(names):
            inclusive[function] += n
    samples = sum(threads.values())

    def shares(counter: Counter) -> list[list]:
        return [[key, round(100.0 * n / samples, 1)] for key, n in counter.most_common(top)] if samples else []

    return {"samples": samples, "threads": shares(threads), "inclusive": shares(inclusive), "own": shares(own)}


def record(pid: int, seconds: float, out: Path, rate: int = 200, gil: bool = False) -> subprocess.Popen:
    """Start py-spy sampling process ``pid`` for ``seconds`` into ``out`` (raw); returns the py-spy process.
    ``gil``: sample only the thread holding the GIL (``gil_profile``), else every thread, idle ones too."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile-serving needs py-spy on PATH (pip install py-spy)")
    command = [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
               "--format", "raw", "--threads", *(["--gil"] if gil else ["--idle"]), "--nonblocking", "--output", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(spy: subprocess.Popen, out: Path, top: int, gil: bool = False) -> dict:
    """Wait for ``record``'s py-spy and read its samples; a py-spy failure is reported, not raised."""
    _, errors = spy.communicate(timeout=120)
    if spy.returncode != 0 or not out.exists():
        return {"error": (errors or "").strip().splitlines()[-1:] or [f"py-spy exited {spy.returncode}"]}
    return gil_profile(out.read_text(), top=top) if gil else profile(out.read_text(), top=top)


def table(result: dict, rows: int = 15) -> str:
    """The profile as a markdown table: functions by inclusive share (the frames on every sample, the
    thread's own entry chain, left out), each with its own share; then the largest own shares."""
    if "error" in result:
        return f"thread profile: py-spy failed: {result['error']}"
    own = dict(map(tuple, result["own"]))
    lines = [f"{result['thread']} thread, {result['samples']} py-spy samples:", "| function | inclusive % | own % |", "| --- | --- | --- |"]
    if "threads" in result:
        lines.insert(0, "threads: " + "; ".join(f"{name} {share}%" for name, share in result["threads"]))
    lines += [f"| {name} | {share} | {own.get(name, '')} |" for name, share in [r for r in result["inclusive"] if r[1] < 99.0][:rows]]
    lines.append("own: " + "; ".join(f"{name} {share}%" for name, share in result["own"][:8]))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="py-spy record --format raw --threads output")
    parser.add_argument("--thread", default=SERVING_THREAD)
    parser.add_argument("--gil", action="store_true", help="the samples were taken with --gil: every thread's share of the GIL")
    parser.add_argument("--top", type=int, default=15, help="rows of the inclusive table")
    args = parser.parse_args()
    raw = args.raw.read_text()
    print(table(gil_profile(raw, 40) if args.gil else profile(raw, args.thread), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
