"""Hardware counters of the Qwen3-8B-shape decode step's kernels, read with Nsight Compute.

    ncu --profile-from-start off --clock-control none --launch-skip SKIP --launch-count COUNT \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --metrics "$(python benchmarks/step_counters.py metrics)" \\
        --csv --page details python benchmarks/step_counters.py run --kernels exact > exact.csv
    python benchmarks/step_counters.py read exact.csv [--record]
    python benchmarks/step_counters.py skip --kernels exact --layer 11     # SKIP for the first kernel of layer 11

``run`` builds the Qwen3-8B-shaped pair of ``gpu_graphs.py`` (random bf16 weights, context 2048 of a 4096-slot
pool), captures its AR step (one CUDA graph) with the ``exact`` or ``fast`` kernels, replays it three times, then
once between ``cudaProfilerStart`` and ``cudaProfilerStop``: with ``--profile-from-start off`` Nsight Compute sees
only that step's kernels, in launch order (an embedding, then each layer's kernels: 8 exact, 7 fast; ``skip``
prints where a layer starts). Nsight Compute replays each kernel alone with its caches flushed, so a kernel's
duration there is longer than in the graph (no launch overlap, a cold L2): the counters say what a kernel is
bound by, the graph timings (``exact_kernels.py``) what it costs.

``read`` turns the CSV into one row per kernel: grid, duration, DRAM throughput (% of peak), achieved and
theoretical occupancy, warps per scheduler (active, eligible), cycles per issued instruction, and the three
largest stall reasons (cycles per issued instruction, from ``metrics``' counters). Prints a table and ends with
one JSON line (``--record`` appends it to benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: results.jsonl

KERNELS_PER_LAYER = {"exact": 8, "fast": 7}  # norm, q|k|v, RoPE write, attention, o, norm, gate|up, down (fast: GEMV norms)
STALLS = ("long_scoreboard", "barrier", "wait", "mio_throttle", "lg_throttle", "math_pipe_throttle", "short_scoreboard",
          "not_selected", "selected", "dispatch_stall", "no_instruction", "membar", "sleeping", "drain", "imc_miss",
          "branch_resolving")
COLUMNS = {  # the row's key -> Nsight Compute's metric name in the details page
    "duration_us": "Duration",
    "dram_pct": "DRAM Throughput",
    "occupancy_pct": "Achieved Occupancy",
    "occupancy_limit_pct": "Theoretical Occupancy",
    "active_warps": "Active Warps Per Scheduler",
    "eligible_warps": "Eligible Warps Per Scheduler",
    "cycles_per_issue": "Warp Cycles Per Issued Instruction",
    "registers": "Registers Per Thread",
}
SHARED = "Dynamic Shared Memory Per Block"  # kept as ncu prints it, with its unit


def stall_metric(reason: str) -> str:
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


def number(text: str, unit: str) -> float:
    """A metric's value; durations in µs whatever unit ncu chose."""
    value = float(text.replace(",", ""))
    return value / 1000 if unit in ("ns", "nsecond") else value * 1000 if unit in ("ms", "msecond") else value


def read_rows(text: str) -> list[dict]:
    """One dict per profiled kernel (launch order) from ``ncu --csv --page details`` output (lines before
    its header, the program's own prints, are skipped)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID",'))
    kernels: dict[str, dict] = {}
    for entry in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        row = kernels.setdefault(entry["ID"], {"kernel": entry["Kernel Name"], "grid": entry["Grid Size"], "stalls": {}})
        name, unit, value = entry["Metric Name"], entry["Metric Unit"], entry["Metric Value"]
        if name.startswith("smsp__average_warps_issue_stalled_"):
            row["stalls"][name.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio")] = number(value, "")
        for key, metric in COLUMNS.items():
            if name == metric:
                row[key] = number(value, unit)
        if name == SHARED:
            row["shared"] = f"{value} {unit}"
    return list(kernels.values())


def top_stalls(row: dict, count: int = 3) -> str:
    ranked = sorted(row["stalls"].items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{reason} {value:.1f}" for reason, value in ranked)


def print_table(rows: list[dict]) -> None:
    print("| # | kernel | grid | µs | DRAM % | occupancy % (limit) | warps active / eligible | cycles / issue | top stalls |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['kernel']} | {r['grid']} | {r.get('duration_us', 0):.2f} | {r.get('dram_pct', 0):.1f} | "
              f"{r.get('occupancy_pct', 0):.1f} ({r.get('occupancy_limit_pct', 0):.1f}) | {r.get('active_warps', 0):.2f} / "
              f"{r.get('eligible_warps', 0):.2f} | {r.get('cycles_per_issue', 0):.1f} | {top_stalls(r)} |")


def run_step(kernels: str) -> None:
    """One AR step replayed between the profiler's start and stop (see the module docstring)."""
    import gpu_graphs as gg  # the 8B-shaped pair (imports the executor's backends)
    import torch
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    backend, dims = gg.shaped_backend(ExactOps() if kernels == "exact" else TritonOps())
    step = gg.ArStep(backend, gg.Feeds(dims, 1, 2048))
    step.at(2048)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"one {kernels} AR step profiled")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="one AR step between the profiler's start and stop")
    run.add_argument("--kernels", choices=sorted(KERNELS_PER_LAYER), default="exact")
    skip = commands.add_parser("skip", help="ncu's --launch-skip for the first kernel of a layer")
    skip.add_argument("--kernels", choices=sorted(KERNELS_PER_LAYER), default="exact")
    skip.add_argument("--layer", type=int, default=11)
    commands.add_parser("metrics", help="the stall counters to pass to ncu's --metrics")
    read = commands.add_parser("read", help="a table of ncu's CSV")
    read.add_argument("csv", type=Path)
    read.add_argument("--note", default="", help="kept in the JSON line (which machine, what was profiled)")
    read.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.command == "run":
        run_step(args.kernels)
        return 0
    if args.command == "skip":
        print(1 + args.layer * KERNELS_PER_LAYER[args.kernels])  # the embedding, then whole layers
        return 0
    if args.command == "metrics":
        print(",".join(stall_metric(reason) for reason in STALLS))
        return 0
    rows = read_rows(args.csv.read_text())
    print_table(rows)
    summary = {"name": "step_counters", "command": f"python benchmarks/step_counters.py read {args.csv.name}", "note": args.note,
               "kernels": [{k: v for k, v in r.items() if k != "stalls"} | {"stalls": top_stalls(r, 5)} for r in rows]}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
