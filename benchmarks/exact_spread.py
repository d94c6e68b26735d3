"""How the exact linear spreads a small weight's many rows over the processors, measured per spread.

    python benchmarks/exact_spread.py [--reps 20] [--rows 1,16,240,256] [--record]
    python benchmarks/exact_spread.py --pair 8b --rows 1,16,64      # the Qwen3-8B weights, streamed from memory

The default pair's target weights (q|k|v 448 x 320, o 320 x 320, gate|up 2 x 896 x 320, down 320 x 896, the
LM head 8192 x 320; bf16, random) at the row counts of a decode step (1, 16 owners) and of a cycle at 16
owners (240 draft rows, 256 verify rows); with ``--pair 8b`` the Qwen3-8B shape's (q|k|v 6144 x 4096, o 4096 x
4096, gate|up 2 x 12288 x 4096, down 4096 x 12288, the LM head 151936 x 4096), each call reading one of enough
copies that the weight comes from memory, not L2, as in that model's decode step and verify. For each weight
and row count: µs per call (each call with its epilogue: the norm pass for q|k|v, gate|up and the LM head, the
residual for o and down; 50 calls captured in one CUDA graph; the default pair's weight resident in L2 as in a
tiny model's run) of

- ``exact``: ``ExactOps().linear`` as the product runs it (``plan.exact_linear_launch`` with the widening);
- ``plan``: the plan's spread without the widening (what ran before it);
- ``t{tiles}/bn{block}``: every spread of the exact kernel (tiles per program 1, 2, 4; the plan's two feature
  blocks): the same bits, other speeds;
- ``fast``: ``TritonOps().linear`` (cuBLAS for more than one row, the fused GEMV for one).

Prints a table and ends with one JSON line (``--record`` appends it to benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, UTC
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_graphs as gg  # noqa: E402  (graph_time)
import record  # noqa: E402  (benchmarks/record.py: results.jsonl)

from dflash_trt.runtime.kernels import plan as plan_module  # noqa: E402
from dflash_trt.runtime.kernels.exact_ops import ExactOps  # noqa: E402
from dflash_trt.runtime.kernels.triton_ops import TritonOps  # noqa: E402

# name: (N, K, gated, norm before, residual after) of each pair's target
PAIRS = {
    "default": {
        "qkv": (448, 320, False, True, False), "o": (320, 320, False, False, True), "gate_up": (896, 320, True, True, False),
        "down": (320, 896, False, False, True), "lm_head": (8192, 320, False, True, False),
    },
    "8b": {
        "qkv": (6144, 4096, False, True, False), "o": (4096, 4096, False, False, True), "gate_up": (12288, 4096, True, True, False),
        "down": (4096, 12288, False, False, True), "lm_head": (151936, 4096, False, True, False),
    },
}
CALLS = 50  # calls per captured graph
STREAMED_BYTES = 256 * 1024**2  # the 8B weights' copies read in turn: several times any L2, so every call reads memory


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default="1,16,240,256", help="comma-separated row counts")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="default", help="whose weight shapes (8b: streamed from memory)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    return parser.parse_args()


def spread_fixed(tiles: int, block_n: int):
    """A stand-in for ``plan.exact_wider_spread`` that returns one spread (``None``: the plan's, unwidened)."""
    def chosen(plan, rows, plan_tiles, plan_block_n, out_features, processors):
        if tiles is None:
            return plan_tiles, plan_block_n
        return min(tiles, plan_tiles), block_n
    return chosen


def call_time(ops, name: str, spec: tuple, M: int, stream, reps: int, streamed: bool = False) -> float:
    """µs per call of ``ops.linear`` on weight ``name`` of shape ``spec`` (a ``PAIRS`` entry) with M rows (a CUDA graph of
    ``CALLS`` calls; ``streamed``: the calls take the weight's copies in turn, ``STREAMED_BYTES`` of them at least, so
    none is read from L2)."""
    N, K, gated, normed, residual = spec
    shape = ((2 * N if gated else N), K)
    copies = max(2, -(-STREAMED_BYTES // (shape[0] * K * 2))) if streamed else 1
    weights = [torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, K**-0.5) for _ in range(copies)]
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    norm = torch.ones(K, dtype=torch.bfloat16, device="cuda") + 0.1
    res = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    out_dtype = torch.float32 if name == "lm_head" else None

    def calls():
        for i in range(CALLS):
            ops.linear(x, weights[i % copies], norm=norm if normed else None, eps=1e-6, gated=gated, residual=res if residual else None,
                       out_dtype=out_dtype)
    return gg.graph_time(stream, calls, reps) / CALLS * 1e3


def measure(weights: dict, rows: list[int], reps: int, streamed: bool = False) -> list[dict]:
    stream = torch.cuda.Stream()
    exact, fast = ExactOps(), TritonOps()
    processors = exact.processors(torch.device("cuda"))
    widen = plan_module.exact_wider_spread
    results = []
    for name, spec in weights.items():
        N, K, gated = spec[:3]
        plan = plan_module.exact_linear_plan(N, K, gated, 2, processors)
        for M in rows:
            row = {"weight": name, "rows": M}
            chosen = plan_module.exact_linear_launch(plan, M, gated, 2, N, processors)
            row["spread"] = f"t{chosen[0]}/bn{chosen[1]}"
            row["exact"] = call_time(exact, name, spec, M, stream, reps, streamed)
            variants = {"plan": (None, None)} | {f"t{t}/bn{bn}": (t, bn) for t in (4, 2, 1) for bn in sorted({plan.block_n, plan.block_n_rows})}
            try:
                for label, (tiles, block_n) in variants.items():
                    plan_module.exact_wider_spread = spread_fixed(tiles, block_n)
                    row[label] = call_time(exact, name, spec, M, stream, reps, streamed)
            finally:
                plan_module.exact_wider_spread = widen
            row["fast"] = call_time(fast, name, spec, M, stream, reps, streamed)
            results.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            print(results[-1], flush=True)
    return results


def table(results: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in results for key in row))
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in results]
    return "\n".join(lines)


def main() -> int:
    args = arguments()
    if not torch.cuda.is_available():
        print("exact_spread needs a CUDA GPU", file=sys.stderr)
        return 1
    results = measure(PAIRS[args.pair], [int(m) for m in args.rows.split(",")], args.reps, streamed=args.pair == "8b")
    print(table(results))
    many = [row for row in results if row["rows"] > 16]
    summary = {
        "name": "exact_spread", "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": record.machine(),
        "command": "python benchmarks/exact_spread.py " + " ".join(sys.argv[1:]), "pair": args.pair, "rows": results,
        "many_rows_us": {key: round(sum(row[key] for row in many), 2) for key in ("exact", "plan", "fast")},
    }
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
