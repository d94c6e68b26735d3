"""Where the CPU main job's device time goes, plain decoding against DFlash: prefill, decode steps, cycles.

    python benchmarks/cpu_phases.py [--runs 3] [--limit 8] [--max-new-tokens 128] [--record]

Runs the main job (`dflash-trt bench`: ONNX Runtime, the embedded pair's cached export, both modes, a warm-up
pass first) ``--runs`` times and splits each mode's device time into phases from its stats (each launch
counted once: ``analysis.throughput.calls``): ``prefill`` (a session's first row: its prompt's
``target_prefill`` chunks and, with DFlash, the draft's context drained through ``draft_context`` between
them; bench gives every prompt a session of its own), plain ``decode`` steps, and cycles by the draft they
ran (``static``: the block graph; ``dynamic``: a drain cycle) and owner count, with the tokens each phase
returned. Then ``draft_context`` alone at a few row counts, interleaved: its fixed part is the block and head
the draft network computes whatever the context rows (the contract's ``anchor = -1`` profile).

Per run: the speedup bench printed, the decode-phase ratio (plain's device ms per token after prefill over
DFlash's) and DFlash's prefill over plain's. Prints the tables and ends with one JSON line (``--record``:
appended to benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import torch

from dflash_trt import demo
from dflash_trt.analysis.throughput import calls
from dflash_trt.export import contract as c
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from dflash_trt.runtime import command
from dflash_trt.runtime.backends.ort_backend import OrtBackend

import record  # benchmarks/record.py: results.jsonl

MODES = ("plain", "dflash")
CONTEXT_ROWS = (16, 128, 256)  # draft_context row counts timed (the main job's chunk is 256)


def phases(stats: Path) -> pl.DataFrame:
    """One row per (phase, owners): launches, device ms, tokens returned, tokens per ms."""
    rows = pl.scan_parquet(stats)
    first = rows.group_by("session").agg(pl.col("cycle_id").min().alias("cycle_id")).with_columns(pl.lit(True).alias("first"))
    per_call = calls(rows).join(first.select("cycle_id", "first"), on="cycle_id", how="left")
    phase = pl.when(pl.col("first")).then(pl.lit("prefill")).when(pl.col("mode") == "target").then(pl.lit("decode")).otherwise(pl.col("mode"))
    return (
        per_call.with_columns(phase.alias("phase"))
        .group_by("phase", "owners")
        .agg(pl.len().alias("launches"), (pl.col("draft_ms") + pl.col("verify_ms")).sum().alias("ms"), pl.col("emitted").sum().alias("tokens"))
        .with_columns((pl.col("tokens") / pl.col("ms")).alias("tokens_per_ms"))
        .sort("phase", "owners")
        .collect()
    )


def bench(limit: int, max_new_tokens: int, out: Path) -> dict:
    """One `dflash-trt bench` run; its last line (the comparison)."""
    argv = ["dflash-trt", "bench", "--limit", str(limit), "--max-new-tokens", str(max_new_tokens), "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def context_costs(export: Path, reps: int) -> dict[int, float]:
    """Median ms of ``draft_context`` at each of CONTEXT_ROWS rows, run in turn ``reps`` times (after one untimed round)."""
    backend = OrtBackend.from_export(export)
    try:
        width, times = backend.dims.tap_width, {rows: [] for rows in CONTEXT_ROWS}
        for rep in range(reps + 1):
            for rows in CONTEXT_ROWS:
                feeds = {c.TAPS: torch.randn((1, rows, width)), c.START: torch.zeros((1,), dtype=torch.int64)}
                started = time.perf_counter()
                backend.run(c.DRAFT_CONTEXT, feeds, 0)
                if rep:
                    times[rows].append((time.perf_counter() - started) * 1000.0)
        return {rows: statistics.median(t) for rows, t in times.items()}
    finally:
        backend.close()


def summary_of(tables: dict[str, pl.DataFrame], result: dict) -> dict:
    """A run's figures: each phase's rows, prefill ms per mode, the decode-phase ratio, bench's speedup."""
    prefill = {m: float(t.filter(pl.col("phase") == "prefill")["ms"].sum()) for m, t in tables.items()}
    after = {m: t.filter(pl.col("phase") != "prefill").select(pl.col("ms").sum(), pl.col("tokens").sum()).row(0) for m, t in tables.items()}
    per_token = {m: ms / tokens for m, (ms, tokens) in after.items()}
    return {
        "speedup": result["speedup"],
        "tokens_per_s": {m: result[m]["tokens_per_s"] for m in MODES},
        "tau": result["dflash"]["tau"],
        "prefill_ms": {m: round(v, 1) for m, v in prefill.items()},
        "decode_phase_ratio": round(per_token["plain"] / per_token["dflash"], 3),
        "phases": {m: [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for row in t.to_dicts()] for m, t in tables.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20, help="draft_context timings per row count")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for index in range(args.runs):
            out = Path(work) / str(index)
            result = bench(args.limit, args.max_new_tokens, out)
            tables = {mode: phases(out / mode / "stats.parquet") for mode in MODES}
            for mode, table in tables.items():
                print(f"run {index + 1}, {mode}:\n{table}")
            runs.append(summary_of(tables, result))
    pair = argparse.Namespace(artifacts=None, target=DEFAULT_PAIR_DIR / "target", draft=DEFAULT_PAIR_DIR / "draft", cache=command.default_cache_dir())
    export = demo.export_dir(pair)  # the main job's export (bench made it)
    context = context_costs(export, args.reps)
    print("| run | speedup | τ | prefill ms plain / DFlash | decode-phase ratio |\n| --- | --- | --- | --- | --- |")
    for index, run in enumerate(runs, 1):
        print(f"| {index} | {run['speedup']} | {run['tau']} | {run['prefill_ms']['plain']} / {run['prefill_ms']['dflash']} | {run['decode_phase_ratio']} |")
    print("draft_context ms by rows: " + ", ".join(f"{rows}: {ms:.2f}" for rows, ms in context.items()))
    summary = {"name": "cpu_phases", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/cpu_phases.py", *sys.argv[1:]]), "runs": runs,
               "draft_context_ms": {str(rows): round(ms, 3) for rows, ms in context.items()}}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
