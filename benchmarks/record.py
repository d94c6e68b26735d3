"""Where the benchmarks' figures go: ``--record`` appends rows (one JSON object a line) to
benchmarks/results.jsonl, each with the commit it measured when the checkout is a git repository."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.jsonl"


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=RESULTS.parent, capture_output=True, text=True, timeout=10, check=True).stdout.strip()


def commit() -> str | None:
    """The checkout's short commit (with ``+`` when it has uncommitted changes), or None outside git."""
    try:
        return _git("rev-parse", "--short", "HEAD") + ("+" if _git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def append_rows(rows: Iterable[dict]) -> None:
    """Append ``rows`` to results.jsonl; a row without a ``commit`` gets the checkout's."""
    head = commit()
    with RESULTS.open("a") as file:
        for row in rows:
            file.write(json.dumps(row if "commit" in row or head is None else {**row, "commit": head}) + "\n")


def machine() -> str:
    """The GPU (or "CPU") and torch, as the rows' ``machine`` names them; torch imported here, so a benchmark that
    needs only this does not pull in the executor (and polars) through gpu_e2e."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{name}, torch {torch.__version__}"


def finish(summary: dict, record: bool) -> int:
    """A benchmark's end: ``summary`` appended when ``record`` (``--record``), printed as the last line; exit status 0."""
    if record:
        append_rows([summary])
    print(json.dumps(summary))
    return 0
