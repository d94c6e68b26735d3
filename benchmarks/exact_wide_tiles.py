"""Four 16-row tiles or one 64-row tile: the exact linear's many-row launches, their bits and their speed.

    python benchmarks/exact_wide_tiles.py [--pair 8b] [--rows 64,128,256] [--reps 10] [--record]

A launch of four 16-row tiles per program (``plan.exact_linear_launch``: from 33 rows on) runs four 16-row
MMAs per K step; ``ExactOps(wide_tiles=True)`` runs the same rows as one 64-row tile, which Triton compiles to
Hopper's warp-group MMA (``wgmma``) on sm90, the instruction cuBLAS uses at these row counts. The K order of
every row's sums is the same (the weight's K steps, 16 products per MMA step, in order); whether the two
instructions round a step's sums alike is the hardware's to say, and this measures it. For each weight of the
pair's target (``exact_spread.PAIRS``; bf16, random; the norm pass or the residual of the product) and each row
count:

- ``same``: the wide launch's output bit-identical to the product's (16-row tiles) at that row count, and every
  sampled row's to that row computed alone (one row, padded to a 16-row tile: the decode step's launch);
- µs per call of both (``exact_spread.call_time``: 50 calls in a CUDA graph; the Qwen3-8B weights streamed from
  memory) and of cuBLAS (``TritonOps``);
- for a weight whose plan holds at most two tiles a program (the H100 / H200 table's q|k|v and gate|up), the wide
  launch with the plan's tiles raised to four (``wide_t4_us``, and whether its rows are the same bits: ``same_t4``),
  what the table's entry would be with wide tiles.

Prints a table and ends with one JSON line (``--record`` appends it to benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from datetime import datetime, UTC
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exact_spread  # noqa: E402  (PAIRS, call_time)
import record  # noqa: E402  (benchmarks/record.py: results.jsonl)

from dflash_trt.runtime.kernels.exact_ops import ExactOps  # noqa: E402
from dflash_trt.runtime.kernels.plan import exact_linear_plan  # noqa: E402
from dflash_trt.runtime.kernels.triton_ops import TritonOps  # noqa: E402

SAMPLED_ROWS = 8  # rows per row count also computed alone


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", choices=sorted(exact_spread.PAIRS), default="8b")
    parser.add_argument("--rows", default="64,128,256", help="comma-separated row counts (33 or more: four tiles a program)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    return parser.parse_args()


def same_bits(name: str, spec: tuple, M: int, seed: int, wide: ExactOps | None = None) -> dict:
    """The wide launch's rows (``wide``: ``ExactOps(wide_tiles=True)`` by default) against the product's launch of
    M rows and against sampled rows alone."""
    N, K, gated, normed, residual = spec
    generator = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(((2 * N if gated else N), K), device="cuda", generator=generator) * K**-0.5).to(torch.bfloat16)
    x = torch.randn(M, K, device="cuda", generator=generator).to(torch.bfloat16)
    norm = (torch.rand(K, device="cuda", generator=generator) + 0.5).to(torch.bfloat16)
    res = torch.randn(M, N, device="cuda", generator=generator).to(torch.bfloat16)
    out_dtype = torch.float32 if name == "lm_head" else None

    def run(ops, rows: slice):
        return ops.linear(x[rows], w, norm=norm if normed else None, eps=1e-6, gated=gated,
                          residual=res[rows] if residual else None, out_dtype=out_dtype)

    narrow, wide = ExactOps(), wide or ExactOps(wide_tiles=True)
    many, tile = run(narrow, slice(0, M)), run(wide, slice(0, M))
    sampled = sorted({0, M - 1, *torch.randint(0, M, (SAMPLED_ROWS - 2,), generator=generator, device="cuda").tolist()})
    alone = sum(torch.equal(run(narrow, slice(r, r + 1))[0], tile[r]) for r in sampled)
    torch.cuda.synchronize()
    return {"same_as_tiles": bool(torch.equal(many, tile)), "rows_differing": int((many != tile).any(dim=1).sum()),
            "same_as_alone": f"{alone}/{len(sampled)}"}


def main() -> int:
    args = arguments()
    if not torch.cuda.is_available():
        print("exact_wide_tiles needs a CUDA GPU", file=sys.stderr)
        return 1
    stream, streamed = torch.cuda.Stream(), args.pair == "8b"
    narrow, wide, fast = ExactOps(), ExactOps(wide_tiles=True), TritonOps()
    rows = []
    for name, spec in exact_spread.PAIRS[args.pair].items():
        for M in (int(m) for m in args.rows.split(",")):
            row = {"weight": name, "rows": M} | same_bits(name, spec, M, seed=M)
            for label, ops in (("tiles_us", narrow), ("wide_us", wide), ("fast_us", fast)):
                row[label] = round(exact_spread.call_time(ops, name, spec, M, stream, args.reps, streamed), 2)
            plan = exact_linear_plan(*spec[:3], 2, narrow.processors(torch.device("cuda")))
            if plan.tiles < 4:
                four = ExactOps(wide_tiles=True, linear_plans={spec[:3]: dataclasses.replace(plan, tiles=4)})
                row["same_t4"] = same_bits(name, spec, M, seed=M, wide=four)["same_as_tiles"]
                row["wide_t4_us"] = round(exact_spread.call_time(four, name, spec, M, stream, args.reps, streamed), 2)
            rows.append(row)
            print(row, flush=True)
    print(exact_spread.table(rows))
    summary = {
        "name": "exact_wide_tiles", "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": record.machine(),
        "command": "python benchmarks/exact_wide_tiles.py " + " ".join(sys.argv[1:]), "pair": args.pair, "rows": rows,
        "all_same": all(r["same_as_tiles"] and r.get("same_t4", True) and r["same_as_alone"].split("/")[0] == r["same_as_alone"].split("/")[1]
                        for r in rows),
        "us": {label: round(sum(r[label] for r in rows), 2) for label in ("tiles_us", "wide_us", "fast_us")},
    }
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
