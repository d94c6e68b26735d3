"""What the Qwen3-8B-shape decode step would gain without its latency-bound launches: timing bounds, not a product.

    python benchmarks/step_bounds.py [--rounds 5] [--reps 20] [--record]

The exact AR step (``gpu_graphs.py``'s pair and step: random bf16 weights, context 2048 of a 4096-slot pool, one
CUDA graph) captured five times from one backend: as the product runs it; with every RMSNorm pass skipped (each
product reads its input un-normed); with the RoPE / K-V write skipped (queries read unrotated from the q|k|v
output, the cache left as it is); with both skipped; with the attention skipped (the o product reads the queries).
The skipped variants compute wrong values on purpose: their time is the most that fusing those launches into their
neighbours (the norms into the products, the RoPE write into the attention) or a faster attention could save. The
graphs are replayed in turn, ``--rounds`` times ``--reps`` replays each (medians), so a drift of the GPU falls on
all of them alike. Prints a table and ends with one JSON line
(``--record`` appends it to benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: results.jsonl

VARIANTS = {  # name -> the launches skipped: norms, RoPE writes, attentions
    "exact": (False, False, False), "no_norm": (True, False, False), "no_rope": (False, True, False),
    "neither": (True, True, False), "no_attention": (False, False, True),
}


def skipping_ops():
    """``ExactOps`` whose norm passes, RoPE writes and attentions can be switched off while a graph is captured."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    class Skipping(ExactOps):
        no_norm = False
        no_rope = False
        no_attention = False

        def linear(self, x, weight, bias=None, norm=None, eps=0.0, gated=False, residual=None, out=None, out_dtype=None, tap=None,
                   scale=None):
            return super().linear(x, weight, bias, None if self.no_norm else norm, eps, gated, residual, out, out_dtype, tap, scale)

        def qk_rope_write(self, qkv, start, tokens, heads, kv_heads, head_dim, *args, **kwargs):
            if not self.no_rope:
                return super().qk_rope_write(qkv, start, tokens, heads, kv_heads, head_dim, *args, **kwargs)
            # q as the attention reads it, [n, T, Hq, D], a view of the product's output (no launch)
            return qkv[:, : heads * head_dim].view(qkv.shape[0] // tokens, tokens, heads, head_dim) if heads else None

        def attention(self, q, *args, **kwargs):
            return q if self.no_attention else super().attention(q, *args, **kwargs)  # the queries stand in for its output

    return Skipping()


def measure(rounds: int, reps: int) -> dict[str, list[float]]:
    """Device ms of each variant's AR step replay, one median per round."""
    import gpu_graphs as gg

    ops = skipping_ops()
    backend, dims = gg.shaped_backend(ops)
    feeds = gg.Feeds(dims, 1, 2048)
    steps = {}
    for name, skipped in VARIANTS.items():
        ops.no_norm, ops.no_rope, ops.no_attention = skipped  # read while the step is captured
        steps[name] = gg.ArStep(backend, feeds)
        steps[name].at(2048)
    return gg.alternated_ms(backend.stream.torch, steps, rounds, reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    times = measure(args.rounds, args.reps)
    base = statistics.median(times["exact"])
    print("| AR step | device ms (median of rounds) | per round | saved against exact, ms |")
    print("| --- | --- | --- | --- |")
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        rows.append({"variant": name, "ms": round(median, 4), "rounds": [round(v, 4) for v in values], "saved_ms": round(base - median, 4)})
        print(f"| {name} | {median:.4f} | {', '.join(f'{v:.4f}' for v in values)} | {base - median:+.4f} |")
    summary = {"name": "step_bounds", "machine": record.machine(), "command": " ".join(["python benchmarks/step_bounds.py", *sys.argv[1:]]),
               "context": 2048, "rows": rows}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
