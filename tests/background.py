"""Long CPU-only checks run as background processes from the end of collection, so a full run's idle core
works on them while the first runs other tests (the checks under Triton's interpreter take ~2 minutes of a
core each run; run by their module fixtures when needed, they held both cores while the tests waited).

A test module lists its jobs in ``background_jobs() -> {key: argv}`` ({} where they cannot run; ``python(script)``
makes a job's argv, at a lower priority than the tests). conftest.py starts the jobs of every module with a test
selected; the module's fixture takes a job's output with ``output(key, argv)``, which starts the job then if
nothing did (a run that selected no test of the module at collection, e.g. a fixture shared elsewhere).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import NamedTuple

NICE = 5  # below the tests' own processes: the background takes what they leave idle


class _Job(NamedTuple):
    process: subprocess.Popen
    stdout: object  # temporary files: a pipe would fill and stall a job nobody reads yet
    stderr: object


_jobs: dict[str, _Job] = {}


def interpreted_env() -> dict[str, str]:
    """The environment of a job under Triton's interpreter (set before triton is imported)."""
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")


def python(script: str) -> list[str]:
    """A job running ``script`` at a lower priority (``NICE``)."""
    return [sys.executable, "-c", f"import os\nos.nice({NICE})\n{script}"]


def start(key: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    """Start ``argv`` as job ``key`` unless it was started; ``env`` None: ``interpreted_env()`` (every job's so far)."""
    if key in _jobs:
        return
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115  (closed by stop_all)
    process = subprocess.Popen(argv, env=interpreted_env() if env is None else env, stdout=out, stderr=err, text=True)
    _jobs[key] = _Job(process, out, err)


def output(key: str, argv: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> tuple[str, str]:
    """(stdout, stderr) of job ``key``, started now if it was not, once it ended; its returncode is the caller's to
    judge from what it printed. A job past ``timeout`` s is killed (TimeoutExpired)."""
    start(key, argv, env)
    job = _jobs[key]
    try:
        job.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.process.kill()
        job.process.wait()
        raise
    texts = []
    for stream in (job.stdout, job.stderr):
        stream.seek(0)
        texts.append(stream.read())
    return texts[0], texts[1]


def stop_all() -> None:
    """End every job still running (a cut-short run), and close their files."""
    for job in _jobs.values():
        if job.process.poll() is None:
            job.process.kill()
            job.process.wait()
        job.stdout.close()
        job.stderr.close()
    _jobs.clear()
