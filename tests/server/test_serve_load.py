"""benchmarks/serve_load.py's load-generator check: windows whose pinned clients ran out of CPU are flagged."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(mode: str, repeat: int, tok_s: float, bound: bool) -> dict:
    return {"front": "process", "mode": mode, "clients": 64, "repeat": repeat, "output_tokens_per_s": tok_s, "client_bound": bound}


def test_a_window_whose_clients_ran_out_of_cpu_is_flagged_and_counted_in_its_ratio():
    """Bug: the serve ladder pins its openai clients to four cores, and at 64 streams they used 97% of them (median of
    the windows since 2026-12-06, ~2.2-5.3 ms of client CPU per streamed request): both modes then ran at the load
    generator's request rate, so their ratio said as much about the clients as about the server, and nothing in the
    table or the rows said so. A window's clients at 90% of their pinned cores or more must be flagged (not when they
    were not pinned: they share the host, no capacity of their own), and a ratio must count the flagged windows of
    each side (mode, off) among the repeats it pairs, whatever the order of the runs."""
    sys.path.insert(0, str(BENCHMARKS))
    from serve_load import (  # benchmarks/serve_load.py
        CLIENT_BOUND,
        client_load,
        ratio_rows,
    )

    assert client_load(0.9 * 400.0, 4) == CLIENT_BOUND  # the threshold itself is bound
    assert client_load(387.4, 4) >= CLIENT_BOUND > client_load(230.0, 4)
    assert client_load(387.4, None) is None and client_load(None, 4) is None
    assert client_load(150.0, 2) == 0.75  # a share of the pinned cores, however many
    assert client_load(720.0, 4) == 1.8  # hyperthreads: a core's two CPUs count as that core, so the share may pass 1

    runs = [_run("off", 2, 70.0, True), _run("on", 1, 90.0, True), _run("off", 1, 80.0, False), _run("on", 2, 95.0, True),
            _run("on", 3, 99.0, True)]  # the third repeat has no off window: it pairs nothing and counts nowhere
    (row,) = ratio_rows(runs)
    assert (row["mode"], row["windows"], row["client_bound"]) == ("on", 2, [2, 1])
    assert row["ratio"] == round((90.0 + 95.0) / 2 / ((80.0 + 70.0) / 2), 3)
    unflagged = ratio_rows([{k: v for k, v in run.items() if k != "client_bound"} for run in runs])  # rows recorded before the flag
    assert unflagged[0]["client_bound"] == [0, 0]
