"""Check scripts under Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton is imported), several
at once: one subprocess each, one thread each (a CI box's two cores), their printed results merged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PREFIX = "RESULTS "  # a script ends by printing this and a JSON object of {check: "ok" or its traceback}


def run_interpreted(scripts: list[str], timeout: float = 600) -> dict[str, str]:
    """Run ``scripts`` (Python source) at once under the interpreter; the union of their results. A script that
    prints no results fails the caller with its output's end; one failed or timed out, none is left running."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for script in scripts]
    results: dict[str, str] = {}
    try:
        for run in runs:
            stdout, stderr = run.communicate(timeout=timeout)
            line = next((l for l in stdout.splitlines() if l.startswith(PREFIX)), None)
            assert line is not None, stdout[-3000:] + stderr[-3000:]
            results |= json.loads(line[len(PREFIX):])
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    return results
