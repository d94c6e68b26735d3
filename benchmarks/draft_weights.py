"""What an fp8 draft costs in acceptance: the default pair with its draft's weights in the model's dtype and in fp8.

    python benchmarks/draft_weights.py [--prompts 16] [--max-new-tokens 128] [--sessions 4] [--dtypes fp32 bf16]
        [--device cpu] [--kernels fast] [--record]

``draft_weights="fp8"`` (``runtime/kernels/quant.py``) halves the bytes a draft launch streams; only the proposals
can change, since the target verifies every token. This measures what that costs: per dtype, plain decoding and
DFlash (``--policy always``: every round a cycle, so τ is the draft's alone) over the pair's held-out prompts
(``gpu_e2e.default_pair``: the last 192 tokens of each; its dims: verify lengths up to 15), with the draft in the model's dtype and in fp8. Per row: τ (tokens per cycle), the
cycles, DFlash's outputs identical to plain decoding's, and the seconds the pass took (on the CPU a check, not a
speed). The CPU runs the fast path's torch twin (``--kernels fast``); ``--device cuda --kernels exact`` the GPU's.
Prints a table and ends with one JSON line; ``--record`` appends a row per pass to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from gpu_e2e import default_pair, dims_of  # noqa: E402  (the shipped pair, its held-out prompts, the export's dims)

from dflash_trt.runtime.backends import TorchBackend  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.generate import collect, stream  # noqa: E402
from dflash_trt.runtime.serving.batcher import Request  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernels", default="fast", help="the torch backend's kernels (fast: the CPU twin on the CPU; exact on CUDA)")
    parser.add_argument("--record", action="store_true")
    return parser.parse_args()


def passes(args, dtype: str) -> list[dict]:
    """Plain decoding (the model-dtype backend), then DFlash with each draft: one row per DFlash pass."""
    plain, rows = None, []
    for weights in ("model", "fp8"):
        target, draft, prompts, stop = default_pair(DTYPES[dtype])
        requests = [Request(prompt, args.max_new_tokens, stop) for prompt in prompts[: args.prompts]]
        dims = dims_of(target, draft, args.sessions, DTYPES[dtype])
        with TorchBackend(target, draft, dims, args.sessions, device=args.device, kernels=args.kernels, draft_weights=weights) as backend:
            for speculate in (False, True) if plain is None else (True,):
                started = time.perf_counter()
                with Executor(backend, max_sessions=args.sessions, speculate=speculate, policy="always") as executor:
                    tokens = [c.tokens for c in collect(stream(executor, requests, args.sessions), len(requests))]
                    cycles = executor.cycle_stats()
                seconds = time.perf_counter() - started
                if not speculate:
                    plain = tokens
                    continue
                rows.append({"dtype": dtype, "draft_weights": weights, "kernels": backend.kernels, "prompts": len(requests),
                             "max_new_tokens": args.max_new_tokens, "sessions": args.sessions, "cycles": len(cycles),
                             "tau": round(float(cycles["accepted"].sum() + len(cycles)) / max(1, len(cycles)), 3),
                             "identical_to_plain": sum(a == b for a, b in zip(tokens, plain)), "seconds": round(seconds, 1)})
                print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    return rows


def main() -> int:
    args = arguments()
    print("dtype | draft weights | kernels | prompts | new tokens | sessions | cycles | τ | identical to plain | s")
    rows = [row for dtype in args.dtypes for row in passes(args, dtype)]
    command = "python benchmarks/draft_weights.py " + " ".join(sys.argv[1:])
    stamp = {"name": "draft_weights", "date": time.strftime("%Y-%m-%d"), "machine": record.machine(), "command": command}
    if args.record:
        record.append_rows({**stamp, **row} for row in rows)
    print(json.dumps({**stamp, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
