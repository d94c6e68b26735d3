"""How ``dflash_trt.analysis`` scales: a synthetic 10-million-row cycles log, summarized.

Generates a cycles table (and its executes table) with realistic shapes in a
temporary folder, then summarizes it in a fresh child process so that peak
memory (``ru_maxrss``) counts the analysis alone, not the generator. Prints
a table of times and peak memory, and ends with one JSON line.

    python benchmarks/analysis_scale.py [--rows 10000000] [--seed 0] [--unordered] [--keep DIR]

Rows are written in call order, as the runtime appends them; ``--unordered``
shuffles them to measure the fallback where the per-call group-by must hash
(``analysis.load.in_call_order``).

Synthetic distributions (per draft/verify call unless noted):

| quantity | distribution |
| --- | --- |
| owners | 1..8, skewed to full packs (continuous batching) |
| mode | static 93 %, dynamic 5 % (context drains), target 2 % (plain decode) |
| proposed | 15 (block 16) when speculating, 0 in target mode |
| accepted (per owner) | geometric run of successes at the session's α ~ Beta(8, 2), capped at 15 |
| context_rows (per owner) | static: last emitted (1..16); dynamic: 64..2048 |
| draft_ms / verify_ms / host_ms | 1.2 + 0.15·owners / 4.5 + 0.5·owners (±5 %) / 0.2 + Exp(0.1) |
| end_ms | running sum of the three |
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from dflash_trt.runtime.stats import COUNTERS, CYCLE_SCHEMA, EXECUTE_SCHEMA, stats_paths, write_parquet

PROPOSALS = 15
SESSIONS = 4096


def synthetic_cycles(rows: int, seed: int) -> pl.DataFrame:
    """``rows`` cycle rows (``CYCLE_SCHEMA``) with the distributions in the module docstring."""
    rng = np.random.default_rng(seed)
    owners = rng.choice(np.arange(1, 9), size=rows // 3 + 8, p=[0.04, 0.04, 0.04, 0.04, 0.06, 0.08, 0.1, 0.6])
    owners = owners[: np.searchsorted(np.cumsum(owners), rows) + 1]
    calls = len(owners)
    mode = rng.choice(np.array(["static", "dynamic", "target"]), size=calls, p=[0.93, 0.05, 0.02])
    draft_ms = np.where(mode == "target", 0.0, (1.2 + 0.15 * owners) * rng.uniform(0.95, 1.05, calls))
    verify_ms = (4.5 + 0.5 * owners) * rng.uniform(0.95, 1.05, calls)
    host_ms = 0.2 + rng.exponential(0.1, calls)
    end_ms = np.cumsum(draft_ms + verify_ms + host_ms)

    call = np.repeat(np.arange(calls), owners)[:rows]  # call index of each row
    first_row = np.cumsum(owners) - owners
    session = (call * 7 + np.arange(rows) - first_row[call]) % SESSIONS  # distinct within a call
    alpha = rng.beta(8, 2, SESSIONS)[session]
    speculating = mode[call] != "target"
    proposed = np.where(speculating, PROPOSALS, 0)
    accepted = np.minimum(rng.geometric(1 - alpha) - 1, proposed)
    dynamic = mode[call] == "dynamic"
    context_rows = np.where(dynamic, rng.integers(64, 2049, rows), np.where(speculating, rng.integers(1, 17, rows), 0))
    columns = {
        "batch_id": call // 2, "cycle_id": call, "session": session, "owners": owners[call], "mode": mode[call],
        "context_rows": context_rows, "proposed": proposed, "accepted": accepted,
        "bonus": speculating & (accepted == proposed), "emitted": accepted + 1,
        "position": rng.integers(16, 8192, rows), "temperature": np.where(session % 2 == 0, 0.0, 0.7),
        "draft_ms": draft_ms[call], "verify_ms": verify_ms[call], "host_ms": host_ms[call], "end_ms": end_ms[call],
        "policy": np.where(speculating, "estimate", "fixed"), "policy_ratio": np.where(speculating, 1.3, np.nan),
    }
    return pl.DataFrame(columns).cast(CYCLE_SCHEMA).select(list(CYCLE_SCHEMA))


def executes_from(cycles: pl.DataFrame) -> pl.DataFrame:
    """One execute row per batch_id, counters consistent with the cycles (the cross-check passes)."""
    speculative = pl.col("mode") != "target"
    frame = cycles.group_by("batch_id").agg(
        pl.col("session").n_unique().cast(pl.Int32).alias("inputs"),
        pl.lit(0, pl.Int64).alias("target_tokens"),
        pl.lit(True).alias("pending_decode"),
        pl.lit(True).alias("ok"),
        (pl.col("end_ms").max() - pl.col("end_ms").min() + 7.0).alias("wall_ms"),
        pl.col("end_ms").max(),
        speculative.sum().cast(pl.Int64).alias("cycles"),
        pl.col("proposed").cast(pl.Int64).sum(),
        pl.col("accepted").cast(pl.Int64).sum(),
        pl.col("bonus").cast(pl.Int64).sum().alias("bonuses"),
        (speculative & ~pl.col("bonus")).sum().cast(pl.Int64).alias("rejected"),
        pl.col("cycle_id").filter(speculative).n_unique().cast(pl.Int64).alias("draft_forwards"),
    )
    missing = [pl.lit(0, pl.Int64).alias(name) for name in COUNTERS if name not in frame.columns]
    return frame.with_columns(missing).sort("batch_id").select(list(EXECUTE_SCHEMA))


def summarize_in_this_process(cycles_path: Path, out_dir: Path) -> dict:
    """Child side: scan, summarize, write the report; times and own peak memory."""
    from dflash_trt.analysis.load import scan_run
    from dflash_trt.analysis.report import headline, summarize, write_report

    times = {"imports_rss_mib": proc_status_mib("VmRSS")}  # the floor: interpreter + polars + numpy
    start = time.perf_counter()
    run = scan_run(cycles_path)
    times["scan_s"] = time.perf_counter() - start
    start = time.perf_counter()
    summary = summarize(run)
    times["summarize_s"] = time.perf_counter() - start
    start = time.perf_counter()
    write_report(summary, out_dir)
    times["write_report_s"] = time.perf_counter() - start
    return {**times, **peak_memory(), "headline": headline(summary)}


def peak_memory() -> dict:
    """Peak RSS of this process: ru_maxrss (KiB on Linux) and /proc's VmHWM.

    ru_maxrss survives fork + exec, so a child inherits its parent's RSS at
    fork as a floor: the parent therefore stays small (generation runs in a
    child of its own). VmHWM belongs to this process's address space only.
    """
    return {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "vm_hwm_mib": proc_status_mib("VmHWM"),
    }


def proc_status_mib(field: str) -> float | None:
    """A memory field of /proc/self/status in MiB (None off Linux)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return None


def generate_in_this_process(folder: Path, rows: int, seed: int, unordered: bool) -> dict:
    """Child side: write the synthetic cycles and executes tables."""
    cycles_path, executes_path = stats_paths(folder / "bench")
    start = time.perf_counter()
    cycles = synthetic_cycles(rows, seed)
    executes = executes_from(cycles)
    if unordered:
        cycles = cycles.sample(fraction=1.0, shuffle=True, seed=seed)
    write_parquet(cycles, cycles_path, "cycles")
    write_parquet(executes, executes_path, "executes")
    return {
        "generate_s": time.perf_counter() - start,
        "file_mib": cycles_path.stat().st_size / 2**20,
        "executes_file_mib": executes_path.stat().st_size / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unordered", action="store_true", help="shuffle the rows (no call order)")
    parser.add_argument("--keep", type=Path, help="write the files here instead of a temp folder")
    parser.add_argument("--phase", choices=("generate", "summarize"), help=argparse.SUPPRESS)  # child
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # child
    args = parser.parse_args()
    if args.phase == "generate":
        print(json.dumps(generate_in_this_process(args.folder, args.rows, args.seed, args.unordered)))
        return 0
    if args.phase == "summarize":
        print(json.dumps(summarize_in_this_process(stats_paths(args.folder / "bench")[0], args.folder / "report")))
        return 0
    if args.keep is not None:
        return run_benchmark(args.keep, args.rows, args.seed, args.unordered)
    with tempfile.TemporaryDirectory(prefix="analysis_scale_") as folder:
        return run_benchmark(Path(folder), args.rows, args.seed, args.unordered)


def run_benchmark(folder: Path, rows: int, seed: int, unordered: bool) -> int:
    """Parent: generate and summarize in two fresh children, print the table and JSON."""
    result = {"rows": rows, "seed": seed, "unordered": unordered, "polars": pl.__version__}
    result |= child(folder, "--phase", "generate", "--rows", str(rows), "--seed", str(seed),
                    *(["--unordered"] if unordered else []))
    result |= child(folder, "--phase", "summarize")
    print_table(result)
    print(json.dumps(result))
    return 0


def child(folder: Path, *flags: str) -> dict:
    """Run this script as a fresh process on ``folder``; its last stdout line is JSON."""
    argv = [sys.executable, __file__, "--folder", str(folder), *flags]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(result: dict) -> None:
    figures = result["headline"]
    order = "shuffled rows" if result["unordered"] else "rows in call order"
    print(f"analysis scale benchmark: {result['rows']:,} cycle rows ({order}), {figures['calls']:,} calls")
    print(f"  cycles file            {result['file_mib']:10.1f} MiB  (executes {result['executes_file_mib']:.1f} MiB)")
    print(f"  generate + write       {result['generate_s']:10.2f} s   (not part of the analysis)")
    print(f"  scan + validate        {result['scan_s']:10.3f} s")
    print(f"  summarize (collect)    {result['summarize_s']:10.2f} s")
    print(f"  write report           {result['write_report_s']:10.2f} s   (plots, CSV, Markdown)")
    print(f"  peak RSS (analysis)    {result['peak_rss_mib']:10.0f} MiB   (ru_maxrss; VmHWM {result['vm_hwm_mib'] or 0:.0f} MiB)")
    print(f"  RSS after imports      {result['imports_rss_mib'] or 0:10.0f} MiB   (python + polars + numpy, before any scan)")
    print(f"  tau {figures['tau']:.3f}, tokens/s {figures['tokens_per_s']:.0f}, counters match: {figures['counters_match']}")


if __name__ == "__main__":
    sys.exit(main())
