"""A prototype exact attention that computes a split's steps as one batched step, against the product's (issue 23).

    python benchmarks/exact_batched_attention.py [--reps 10] [--warps 4 8] [--record]  # a CUDA GPU: the 8B shape
    TRITON_INTERPRET=1 python benchmarks/exact_batched_attention.py --check  # any machine: its exactness checks
    python benchmarks/exact_batched_attention.py --check                     # the same on a CUDA GPU

The product's exact attention (``exact_ops._attention_kernel``) walks each 256-slot split in four dependent
64-slot steps of an online softmax, four warps sharing each step's 16 x 64 scores (so each step's row maxima and
sums cross warps). ``benchmarks/step_bounds.py`` found the attention on the decode step's critical path whole
(0.43 ms of the 8B-shape step on an H100), one latency-bound chain per split. The prototype here
(``_attention_batched_kernel``) loads the split's keys and values at once and computes its four steps side by
side as one batched step (3-D dots: one warp per step on sm90, ``warpsPerCTA = [4, 1, 1]``), a softmax per step,
the four steps' states then folded in increasing order; the splits' partials and their fold are the product's.
Other bits than the product's kernel, the same at every query count, owner count and capacity: the checks of
``tests/exact_checks.py`` (attention rows across query counts, owners, capacities, pools and fold launches;
against the fp32 reference) run on it with ``--check``. Not a product path: a measurement, kept with its kernel.

On a GPU (default): the 8B-shape pair of ``gpu_graphs.py`` (random bf16, context 2048), µs per layer of the
attention over the 36 layers' caches at T = 1 / 16 queries and n = 1 / 4 owners (CUDA graphs), the product's and the
prototype's at each ``--warps`` count (with 4 warps, one per step; with 8, two: compiled here for sm90 the 4-warp
kernel spills its keys and values to local memory, the 8-warp one hardly); then the exact AR step with each (one
backend, captured once per attention). Prints a table and ends with one JSON line
(``--record`` appends it to benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: results.jsonl
from dflash_trt.runtime.kernels import exact_ops
from dflash_trt.runtime.kernels.exact_ops import _finish_split, _split_of
from dflash_trt.runtime.kernels.triton_ops import MASKED, enter, release

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CONTEXT = 2048


@triton.jit
def batched_dot(a, b, INTERP: tl.constexpr):
    """[S, M, K] @ [S, K, N] -> [S, M, N] fp32 (interpreted: fp32 products summed over K, as ``ordered_dot``)."""
    if INTERP:
        return tl.sum(a.to(tl.float32)[:, :, :, None] * b.to(tl.float32)[:, None, :, :], axis=2)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit(do_not_specialize=["sq_n", "spos_n", "unit0", "QB", "T"])
def _attention_batched_kernel(
    q_ptr, sq_n, sq_h, sq_t, k_ptr, v_ptr, sk_n, sk_h, sk_l, pos_ptr, spos_n, len_ptr, part_ptr, lse_ptr, rows_ptr,
    o_ptr, so_n, so_h, so_t, cnt_ptr, unit0, QB, T, G, HKV, window, scale,
    D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ROWS: tl.constexpr, COMBINE: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``exact_ops._attention_kernel`` with the split's SUB = SPLIT / BLOCK_N steps at once: the slots of step b are
    [s SPLIT + b BLOCK_N, + BLOCK_N) whatever the query tile sees; a step no row of the tile sees adds exact zeros."""
    enter(PDL)
    u, s, i, t, h, row_ok, pos, lo, hi, first, last, live, lives, q, kv_row = _split_of(
        q_ptr, sq_n, sq_h, sq_t, sk_n, sk_h, pos_ptr, spos_n, len_ptr, rows_ptr, unit0, QB, T, G, HKV, window,
        D, BLOCK_Q, BLOCK_N, SPLIT, CAUSAL, WINDOW, ROWS)
    d = tl.arange(0, D)
    slots = s * SPLIT + tl.arange(0, SUB)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [SUB, BLOCK_N]
    inside = (slots >= first) & (slots < last)
    k = tl.load(k_ptr + kv_row + slots[:, :, None] * sk_l + d[None, None, :], mask=inside[:, :, None], other=0.0)
    v = tl.load(v_ptr + kv_row + slots[:, :, None] * sk_l + d[None, None, :], mask=inside[:, :, None], other=0.0)
    q3 = tl.broadcast_to(q[None, :, :], (SUB, BLOCK_Q, D))
    scores = batched_dot(q3, tl.permute(k, (0, 2, 1)), INTERP) * scale  # [SUB, BLOCK_Q, BLOCK_N]
    visible = inside[:, None, :] & row_ok[None, :, None]
    if CAUSAL:
        visible = visible & (slots[:, None, :] <= pos[None, :, None])
    if WINDOW:
        visible = visible & (pos[None, :, None] - slots[:, None, :] < window)
    scores = tl.where(visible, scores, MASKED)
    tops = tl.max(scores, axis=2)  # [SUB, BLOCK_Q]
    p = tl.where(visible, tl.exp(scores - tops[:, :, None]), 0.0)
    sums = tl.sum(p, axis=2)
    accs = batched_dot(p.to(v.dtype), v, INTERP)  # [SUB, BLOCK_Q, D]
    release(PDL)
    top = tl.max(tops, axis=0)  # [BLOCK_Q]
    weights = tl.exp(tops - top[None, :])  # exact zeros for a step that shows a row nothing (its top is MASKED)
    total = tl.sum(weights * sums, axis=0)
    acc = tl.sum(weights[:, :, None] * accs, axis=0)
    _finish_split(acc, top, total, u, s, i, t, h, row_ok, lives, live, lo, hi, part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t,
                  cnt_ptr, D, BLOCK_Q, SPLIT, COMBINE)  # the product's partials and fold


class _Batched:
    """Stands in for ``exact_ops._attention_kernel`` at its launch: the same arguments, the prototype's kernel with
    ``warps`` warps (each count its own arithmetic: one count per comparison) and one stage (the split's keys and
    values are loaded at once)."""

    def __init__(self, warps: int) -> None:
        self.warps = warps

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs |= {"SUB": kwargs["SPLIT"] // kwargs["BLOCK_N"], "num_stages": 1, "num_warps": self.warps}
            return _attention_batched_kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def batched_attention(warps: int | None):
    """``ExactOps.attention`` launches the prototype with ``warps`` warps inside (None: the product's kernel); a CUDA
    graph captured inside keeps it."""
    kept = exact_ops._attention_kernel
    exact_ops._attention_kernel = kept if warps is None else _Batched(warps)
    try:
        yield
    finally:
        exact_ops._attention_kernel = kept


def check(device: str, warps: list[int]) -> list[dict]:
    """``tests/exact_checks.py``' attention checks with the prototype in place, bf16 and fp32, per warp count (on
    the CPU once: Triton's interpreter has no warps)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import exact_checks

    torch.set_num_threads(1)
    rows = []
    for count in warps if device == "cuda" else warps[:1]:
        with batched_attention(count):
            for dtype in (torch.bfloat16, torch.float32):
                # fp32 at the small cases only: a split's fp32 keys and values at D = 128 (256 KiB) exceed a
                # program's shared memory, where the product's kernel pipelines them a step at a time
                small = device != "cuda" or dtype == torch.float32
                for name, kwargs in (("attention_rows", {"small": small}), ("attention_reference", {})):
                    begun = time.perf_counter()
                    getattr(exact_checks, "check_" + name)(device=device, dtype=dtype, **kwargs)
                    rows.append({"check": name, "dtype": str(dtype).removeprefix("torch."), "warps": count, "passed": True,
                                 "s": round(time.perf_counter() - begun, 1)})
                    print(f"  {name} {dtype}, {count} warps: passed ({rows[-1]['s']} s)", flush=True)
    return rows


def measure(reps: int, warps: list[int]) -> tuple[list[dict], dict]:
    """µs per layer of the product's attention and the prototype's (per warp count) at T = 1 / 16, n = 1 / 4; the AR
    step's device ms with each."""
    import exact_kernels as ek
    import gpu_graphs as gg
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    class Switched(ExactOps):
        def __init__(self, warps: int | None) -> None:
            super().__init__()
            self.batched_warps = warps  # None: the product's kernel

        def attention(self, *args):
            with batched_attention(self.batched_warps):
                return super().attention(*args)

    labels = {"product": None} | {f"batched, {count} warps": count for count in warps}
    ops = Switched(None)
    backend, dims = gg.shaped_backend(ops)
    layers = ek.attention_variant_times(backend, reps, "attention", {label: Switched(count) for label, count in labels.items()},
                                        compare=False)
    steps = {}
    for label, count in labels.items():
        ops.batched_warps = count  # read while the step is captured
        steps[label] = gg.ArStep(backend, gg.Feeds(dims, 1, CONTEXT))
        steps[label].at(CONTEXT)
    times = gg.alternated_ms(backend.stream.torch, steps, 5, reps)
    return layers, {label: round(statistics.median(values), 4) for label, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="the prototype's warps per program, each measured")
    parser.add_argument("--check", action="store_true", help="the exactness checks only (CPU under TRITON_INTERPRET=1, or a GPU)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
    summary = {"name": "exact_batched_attention", "machine": record.machine(),
               "command": " ".join(["python benchmarks/exact_batched_attention.py", *sys.argv[1:]]), "checks": check(device, args.warps)}
    if not args.check:
        layers, ar = measure(args.reps, args.warps)
        labels = list(ar)
        print("| T | owners | " + " | ".join(f"{label} µs / layer" for label in labels) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in labels) + " |")
        for at in range(0, len(layers), len(labels)):
            group = layers[at : at + len(labels)]
            print(f"| {group[0]['tokens']} | {group[0]['owners']} | " + " | ".join(str(r["us_per_layer"]) for r in group) + " |")
        print("AR step ms: " + ", ".join(f"{label} {ms}" for label, ms in ar.items()))
        summary |= {"context": CONTEXT, "layers": layers, "ar_step_ms": ar}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
