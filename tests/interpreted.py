"""Check scripts under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton is imported), several
at once: one subprocess each, one thread each (a CI box's two cores), their printed results merged.

A module whose checks run here defines ``interpreted_scripts()`` (its scripts, or none where Triton is missing);
conftest starts them in the background when the module's tests are collected (``start``), at the lowest CPU
priority, so they take only what the rest of the run leaves idle; the module's fixture then collects them
(``results``) — started by then or, the first time it is asked, right away."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PREFIX = "RESULTS "  # a script ends by printing this and a JSON object of {check: "ok" or its traceback}
BACKGROUND_NICE = 19  # background checks run only where the run's own processes leave a core idle

_started: dict[str, list[subprocess.Popen]] = {}  # module name -> its scripts' processes, in flight or done


def _spawn(script: str, nice: int) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    niced = f"import os\nos.nice({nice})\n{script}"  # in the child itself: no preexec_fn in a process that may run threads
    return subprocess.Popen([sys.executable, "-c", niced], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start(key: str, scripts: list[str], nice: int = BACKGROUND_NICE) -> None:
    """Start ``scripts`` for ``key`` unless they already are (conftest: as the run's tests are collected)."""
    if key not in _started and scripts:
        _started[key] = [_spawn(script, nice) for script in scripts]


def results(key: str, scripts: list[str], timeout: float = 600) -> dict[str, str]:
    """The union of ``key``'s scripts' results, started now (at normal priority) where conftest did not. A script
    that prints no results fails the caller with its output's end; one failed or timed out, none is left running."""
    start(key, scripts, nice=0)
    runs = _started[key]
    merged: dict[str, str] = {}
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=timeout)
            line = next((l for l in stdout.splitlines() if l.startswith(PREFIX)), None)
            assert line is not None, stdout[-3000:] + stderr[-3000:]
            merged |= json.loads(line[len(PREFIX):])
    finally:
        stop(key)
    return merged


def stop(key: str | None = None) -> None:
    """Kill ``key``'s processes still running (every key's without one: the run is ending) and forget them."""
    for name in [key] if key is not None else list(_started):
        for run in _started.pop(name, []):
            if run.poll() is None:
                run.kill()
            run.wait()
