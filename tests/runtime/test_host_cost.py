"""benchmarks/host_cost.py's repeated windows: interleaved modes, medians over every window, ratios within a repeat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _row(mode: str, repeat: int, per_token: float, per_lane_round: float, tok_s: int) -> dict:
    return {"mode": mode, "repeat": repeat, "host_us_per_token": per_token, "host_us_per_lane_round": per_lane_round, "tok_s": tok_s}


def test_host_cost_medians_cover_every_window_and_pair_ratios_within_a_repeat():
    """Bug: host_cost measured each mode once, and one window pair on a shared 2-core box differs from the next by
    ~15%, so an on / off comparison of host work per token decided nothing. The summary must take each mode's median
    over all its windows (not the first, not the last) and divide plain's host µs per token by the drafting mode's
    of the same repeat only (a repeat without an ``off`` window gives no ratio)."""
    sys.path.insert(0, str(BENCHMARKS))
    from host_cost import host_medians  # benchmarks/host_cost.py

    rows = [_row("on", 1, 4.0, 9.0, 100), _row("off", 1, 3.0, 3.1, 90), _row("on", 2, 5.0, 11.0, 80), _row("off", 2, 4.5, 4.4, 70),
            _row("on", 3, 3.5, 8.0, 120)]  # the third repeat's off window missing (e.g. a run stopped early)
    summary = {m["mode"]: m for m in host_medians(rows)}
    assert list(summary) == ["on", "off"]
    for mode, windows in (("on", [r for r in rows if r["mode"] == "on"]), ("off", [r for r in rows if r["mode"] == "off"])):
        got = summary[mode]
        assert got["windows"] == len(windows)
        assert got["host_us_per_token"] == round(_median([r["host_us_per_token"] for r in windows]), 2)
        assert got["host_us_per_lane_round"] == round(_median([r["host_us_per_lane_round"] for r in windows]), 2)
        assert (got["host_us_per_token_min"], got["host_us_per_token_max"]) == (min(r["host_us_per_token"] for r in windows), max(r["host_us_per_token"] for r in windows))
        assert got["tok_s"] == round(_median([r["tok_s"] for r in windows]))
    assert summary["on"]["plain_over_mode"] == [round(3.0 / 4.0, 3), round(4.5 / 5.0, 3)]
    assert summary["off"]["plain_over_mode"] == []


def test_host_cost_repeats_interleave_the_modes_and_summarize_them():
    """Bug: a comparison of modes run back to back (all of one, then all of the other) reads the box's drift as a
    difference of the modes; ``--repeats`` must run on, off, on, off, and its JSON line must carry every window and
    the summary over them."""
    command = [sys.executable, str(BENCHMARKS / "host_cost.py"), "--clients", "2", "--seconds", "0.2", "--repeats", "2", "--modes", "on", "off"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert [(r["mode"], r["repeat"]) for r in data["rows"]] == [("on", 1), ("off", 1), ("on", 2), ("off", 2)]
    medians = {m["mode"]: m for m in data["medians"]}
    for mode in ("on", "off"):
        windows = [r["host_us_per_token"] for r in data["rows"] if r["mode"] == mode]
        assert medians[mode]["windows"] == 2 and medians[mode]["host_us_per_token"] == round(_median(windows), 2)
        assert all(r["requests"] > 0 and r["host_us_per_token"] > 0 for r in data["rows"] if r["mode"] == mode)
    assert len(medians["on"]["plain_over_mode"]) == 2
