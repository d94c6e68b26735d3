"""Stats files on disk: validation errors, the X.parquet / X.executes.parquet pair, the report command."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from dflash_trt.analysis.load import in_call_order, scan_run, scan_stats
from dflash_trt.analysis.report import summarize
from dflash_trt.cli import main
from dflash_trt.errors import StatsError
from dflash_trt.runtime.stats import (
    CYCLE_SCHEMA,
    EXECUTE_SCHEMA,
    KIND_KEY,
    SCHEMA_VERSION,
    VERSION_KEY,
    stats_paths,
    write_parquet,
)

PLOTS = ("acceptance_histogram.png", "position_acceptance.png", "rolling_tau.png", "latency.png")


def cycles_frame() -> pl.DataFrame:
    """Two speculative calls (the first with 2 owners) and one plain-decode step.

    emitted 3 + 1 (call 0, t=100 ms), 4 (call 1, t=150), 1 (call 2, t=200):
    τ = (3 + 1 + 4) / 3 = 8/3; without the executes table: 4 + 1 tokens after t=100 over 0.1 s = 50 tokens/s.
    """
    return pl.DataFrame(
        {
            "batch_id": [0, 0, 1, 2],
            "cycle_id": [0, 0, 1, 2],
            "session": [1, 2, 1, 2],
            "owners": [2, 2, 1, 1],
            "mode": ["dynamic", "dynamic", "static", "target"],
            "context_rows": [12, 9, 3, 0],
            "proposed": [3, 3, 3, 0],
            "accepted": [2, 0, 3, 0],
            "bonus": [False, False, True, False],
            "emitted": [3, 1, 4, 1],
            "position": [12, 9, 15, 10],
            "temperature": [0.0, 0.0, 0.0, 0.0],
            "draft_ms": [1.0, 1.0, 1.0, 0.0],
            "verify_ms": [2.0, 2.0, 2.0, 2.0],
            "host_ms": [0.5, 0.5, 0.5, 0.5],
            "end_ms": [100.0, 100.0, 150.0, 200.0],
            "policy": ["estimate", "estimate", "drain", "fixed"],
            "policy_ratio": [1.2, 1.2, 0.9, float("nan")],
        },
        schema=CYCLE_SCHEMA,
    )


def executes_frame() -> pl.DataFrame:
    columns = {name: [0, 0] for name in EXECUTE_SCHEMA}
    # two executes: 0..110 ms and 110..200 ms -> the run's span is 0.2 s
    columns |= {"ok": [True, True], "pending_decode": [False, True], "wall_ms": [110.0, 90.0], "end_ms": [110.0, 200.0]}
    columns |= {"cycles": [2, 1], "proposed": [6, 3], "accepted": [2, 3], "bonuses": [0, 1]}
    return pl.DataFrame(columns, schema=EXECUTE_SCHEMA)


def baseline_frame() -> pl.DataFrame:
    """Autoregressive: one token per 25 ms, ends 0..100 ms -> 4 tokens after t=0 over 0.1 s = 40 tokens/s."""
    rows = [{**dict.fromkeys(CYCLE_SCHEMA, 0), "cycle_id": i, "mode": "target", "bonus": False, "emitted": 1,
             "temperature": 0.0, "draft_ms": 0.0, "verify_ms": 20.0, "host_ms": 1.0, "end_ms": 25.0 * i,
             "policy": "fixed", "policy_ratio": float("nan")}
            for i in range(5)]
    return pl.DataFrame(rows, schema=CYCLE_SCHEMA)


def test_stats_paths_round_trip(tmp_path):
    """Guards against the runtime and the report disagreeing on where the executes table lives."""
    cycles, executes = stats_paths(tmp_path / "run")
    assert (cycles.name, executes.name) == ("run.parquet", "run.executes.parquet")
    assert stats_paths(cycles) == (cycles, executes)


def test_scan_run_finds_the_executes_table_beside(tmp_path):
    """Guards against the report silently ignoring the counters written next to the cycles file."""
    cycles, executes = stats_paths(tmp_path / "run")
    write_parquet(cycles_frame(), cycles, "cycles")
    assert scan_run(cycles).executes is None
    write_parquet(executes_frame(), executes, "executes")
    run = scan_run(cycles)
    assert run.name == "dflash"  # named by mode: it has speculative cycles
    assert run.executes.collect()["wall_ms"].to_list() == [110.0, 90.0]


def test_random_parquet_names_missing_columns(tmp_path):
    """Guards against a KeyError/ColumnNotFound deep in a query instead of a typed error at the boundary."""
    path = tmp_path / "random.parquet"
    pl.DataFrame({"x": [1, 2], "emitted": [1, 2]}).write_parquet(path)
    with pytest.raises(StatsError) as error:
        scan_stats(path, "cycles")
    message = str(error.value)
    assert "missing columns: batch_id (Int64), cycle_id (Int64)" in message
    assert "end_ms (Float64)" in message
    assert f"{VERSION_KEY!r} missing" in message


def test_mistyped_column_names_both_dtypes(tmp_path):
    """Guards against accepting an Int64 emitted (or float ids) that the writer did not promise."""
    path = tmp_path / "mistyped.parquet"
    write_parquet(cycles_frame().with_columns(pl.col("emitted").cast(pl.Int64)), path, "cycles")
    with pytest.raises(StatsError, match=r"mistyped columns: emitted expected Int32, seen Int64"):
        scan_stats(path, "cycles")


def test_other_schema_version_is_refused(tmp_path):
    """Guards against reading a future/past layout as if it were this one."""
    path = tmp_path / "v99.parquet"
    cycles_frame().write_parquet(path, metadata={KIND_KEY: "cycles", VERSION_KEY: "99"})
    with pytest.raises(StatsError, match=rf"schema version: expected {SCHEMA_VERSION}, seen 99"):
        scan_stats(path, "cycles")


def test_executes_file_given_as_cycles_is_refused(tmp_path):
    """Guards against passing X.executes.parquet as the STATS argument and getting nonsense."""
    path = tmp_path / "run.executes.parquet"
    write_parquet(executes_frame(), path, "executes")
    with pytest.raises(StatsError, match=r"table kind: expected 'cycles', seen 'executes'"):
        scan_stats(path, "cycles")


def test_not_a_parquet_file_and_missing_file(tmp_path):
    """Guards against raw Arrow/OS errors escaping for a text file or a typo in the path."""
    text = tmp_path / "notes.parquet"
    text.write_text("not parquet at all")
    with pytest.raises(StatsError, match="is not a Parquet file"):
        scan_stats(text, "cycles")
    with pytest.raises(StatsError, match="does not exist"):
        scan_stats(tmp_path / "absent.parquet", "cycles")


def test_extra_columns_are_tolerated_and_dropped(tmp_path):
    """Guards against refusing files from a writer that only added columns."""
    path = tmp_path / "extra.parquet"
    write_parquet(cycles_frame().with_columns(pl.lit(1).alias("new_counter")), path, "cycles")
    assert scan_stats(path, "cycles").collect_schema() == pl.Schema(CYCLE_SCHEMA)


def test_report_command_renders_everything(tmp_path, capsys):
    """Guards against a report that crashes, writes empty plots, or prints anything after the JSON line."""
    cycles, executes = stats_paths(tmp_path / "run")
    write_parquet(cycles_frame(), cycles, "cycles")
    write_parquet(executes_frame(), executes, "executes")
    write_parquet(baseline_frame(), tmp_path / "ar.parquet", "cycles")
    out = tmp_path / "report"
    argv = ["report", str(cycles), "--baseline", str(tmp_path / "ar.parquet"), "--compare", str(cycles)]
    assert main([*argv, "--out", str(out)]) == 0
    for name in (*PLOTS, "comparison.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000, name
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# dflash-trt report: dflash")
    assert "| plain " in summary and "| dflash 2 " in summary  # runs named by mode, repeats numbered
    assert "draft_ms is 0" not in summary  # these calls timed their draft apart (the note is for loop cycles)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert figures["tau"] == round(8 / 3, 3)  # floats rounded
    assert figures["tokens_per_s"] == 45.0  # 9 tokens over the executes' span, 0.2 s
    assert figures["speedup"] == round(45.0 / 40.0, 3)
    assert (figures["cycles"], figures["calls"], figures["tokens"]) == (3, 3, 9)
    assert figures["static_share"] == round(1 / 3, 3)
    assert figures["counters_match"] is True
    assert json.loads((out / "headline.json").read_text()) == figures


def test_report_command_on_a_bad_file_fails_cleanly(tmp_path, capsys):
    """Guards against a traceback (instead of exit code 1 and the typed message) on a bad file."""
    path = tmp_path / "random.parquet"
    pl.DataFrame({"x": [1]}).write_parquet(path)
    assert main(["report", str(path)]) == 1
    assert "StatsError" in capsys.readouterr().err


def random_cycles(calls: int, seed: int) -> pl.DataFrame:
    """Random calls of 1..4 owners in call order, phase times shared by a call's rows."""
    rng = np.random.default_rng(seed)
    owners = rng.integers(1, 5, calls)
    call = np.repeat(np.arange(calls), owners)
    n = len(call)
    mode = rng.choice(np.array(["static", "dynamic", "target"]), calls, p=[0.8, 0.15, 0.05])[call]
    proposed = np.where(mode == "target", 0, rng.integers(2, 8, n))
    accepted = np.minimum(rng.geometric(0.3, n) - 1, proposed)
    return pl.DataFrame({
        "batch_id": call // 2, "cycle_id": call, "session": rng.integers(0, 20, n), "owners": owners[call],
        "mode": mode, "context_rows": rng.integers(1, 9, n), "proposed": proposed, "accepted": accepted,
        "bonus": (mode != "target") & (accepted == proposed), "emitted": accepted + 1, "position": np.arange(n),
        "temperature": np.zeros(n), "draft_ms": rng.uniform(1, 2, calls)[call],
        "verify_ms": rng.uniform(3, 5, calls)[call], "host_ms": rng.uniform(0, 1, calls)[call],
        "end_ms": np.cumsum(rng.uniform(5, 8, calls))[call],
        "policy": np.where(mode == "target", "fixed", "estimate"), "policy_ratio": np.where(mode == "target", np.nan, 1.1),
    }).cast(CYCLE_SCHEMA)


def test_row_order_does_not_change_the_summary(tmp_path):
    """Guards against flagging cycle_id sorted without checking (Polars then groups a shuffled
    file's calls wrongly) and against the sorted fast path giving other answers than hashing."""
    frame = random_cycles(calls=150, seed=3)
    ordered, shuffled = tmp_path / "ordered.parquet", tmp_path / "shuffled.parquet"
    write_parquet(frame, ordered, "cycles")
    write_parquet(frame.sample(fraction=1.0, shuffle=True, seed=5), shuffled, "cycles")
    assert in_call_order(scan_stats(ordered, "cycles")) is True
    assert in_call_order(scan_stats(shuffled, "cycles")) is False
    a, b = summarize(scan_run(ordered), window=8), summarize(scan_run(shuffled), window=8)
    for table in ("overview", "tau_by_session", "histogram", "positions", "rolling_tau", "latency",
                  "latency_by_owners", "modes"):
        assert_frame_equal(getattr(a, table).drop("name", strict=False), getattr(b, table).drop("name", strict=False),
                           rel_tol=1e-9, abs_tol=1e-9)
    assert a.overview["calls"][0] == 150


def test_rolling_tau_window_is_capped_to_the_calls(tmp_path, monkeypatch):
    """Guards against a rolling-τ plot titled "over the last 64 calls" for a run of 2 speculative calls
    (its line then spans less than its own window), and against thinning dropping the last call."""
    path = tmp_path / "run.parquet"
    write_parquet(cycles_frame(), path, "cycles")
    summary = summarize(scan_run(path), window=64)
    assert summary.window == 2 and summary.rolling_tau["calls"].to_list() == [1, 2]
    from dflash_trt.analysis import report

    monkeypatch.setattr(report, "MAX_PLOT_POINTS", 10)
    long = tmp_path / "long.parquet"
    frame = random_cycles(calls=150, seed=1)
    write_parquet(frame, long, "cycles")
    thinned = summarize(scan_run(long), window=8)
    calls = thinned.rolling_tau["calls"].to_list()
    speculative_calls = frame.filter(pl.col("mode") != "target")["cycle_id"].n_unique()
    assert thinned.window == 8 and len(calls) <= 12 and calls[-1] == speculative_calls  # the last call is kept

