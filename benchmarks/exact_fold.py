"""A folded RMSNorm for the exact linear: g folded into the weight, Σx² beside the product, the scale at the end.

    python benchmarks/exact_fold.py [--reps 20] [--weights gate_up qkv] [--record]   # the GPU run (~1 min, H200)
    TRITON_INTERPRET=1 python benchmarks/exact_fold.py --check                      # the arithmetic on the CPU

``ExactOps.linear(norm=g)`` runs the RMSNorm as a launch of its own (one program per row), then the product:
72 norm launches in a Qwen3-8B decode step (~2.55 µs each plus a kernel boundary). The norm inside the K loop
(x·g in registers before each dot, before ad4667a) was measured slower on the H200 for a reason its IR does not
show (benchmarks/RESULTS.md, "The exact linear's old norm prologue read in its sm90 IR"). This probes the other
form, which leaves the loop's loads and dots as they are (measured on an H100: slower than the norm launch and
the product together, so not adopted; benchmarks/RESULTS.md, "The folded norm on a GPU"):

    RMSNorm(x) @ Wᵀ = rsqrt(mean(x²) + ε) · (x @ (W·diag(g))ᵀ)

g folded into the weight once (W·g rounded to the weight's dtype), each row's Σx² summed from the x tile the
dot reads (fixed K steps: the same bits whatever M is), the row scale applied to the fp32 sums, then SiLU·mul
for a gated weight. One kernel, one split, 16-row tiles, the product's plan for the feature block, K step,
warps and stages (``plan.exact_linear_plan`` / ``exact_linear_launch``) — but one tile per program and one
split where the product may share weight loads across tiles or split K (q|k|v at the 8B shape has two
splits), so only gate|up at M = 1 and 16 compares like with like.

The GPU run, per Qwen3-8B weight (random bf16, enough copies that one CUDA graph streams >= 1 GiB, past the
L2) and M = 1, 16, 64: µs per call of (a) ``ExactOps().linear(x, W, norm=g)`` (the product as it is: the norm
launch, then the product), (b) ``ExactOps().linear`` on rows already normed (no norm at all: the floor),
(c) this kernel; (c)'s rows of M = 1 and 16 bit-identical to the same rows of an M = 64 launch; the largest
|error| of (a) and of (c) against an fp32 RMSNorm-then-product of the unrounded weights. Prints a table and
ends with one JSON line; ``--record`` appends the rows to benchmarks/results.jsonl.

``--check`` (Triton's interpreter, small shapes, plain and gated, K a multiple of the step and not): (c)
against the fp32 product within two bf16 roundings, and every row of M = 1 / 3 / 16 bit-identical to one
M = 40 launch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_graphs as gg  # noqa: E402  (the CUDA-graph timing)
import record  # noqa: E402  (benchmarks/record.py: results.jsonl)

from dflash_trt.runtime.kernels.exact_ops import INTERPRETED, ExactOps, ordered_dot  # noqa: E402
from dflash_trt.runtime.kernels.plan import EXACT_TILE_M, exact_linear_launch, exact_linear_plan  # noqa: E402

EPS = 1e-6
WEIGHTS = {"gate_up": (12288, 4096, True), "qkv": (6144, 4096, False)}  # name: (N, K, gated) of the Qwen3-8B step
ROWS = (1, 16, 64)
STREAMED_BYTES = 1 << 30  # one timed graph reads at least this much weight


@triton.jit(do_not_specialize=["M"])  # one compiled kernel whatever M is
def _folded_kernel(x_ptr, w_ptr, o_ptr, M, N, K, eps, GATED: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, INTERP: tl.constexpr):
    """Program (TM rows, BN features): acc = x @ W'ᵀ over K in BK steps, Σx² from the same x tiles; then
    y = act(rsqrt(Σx² / K + eps) · acc), rounded to the weight dtype. W' = W·diag(g) ([2N, K] gated)."""
    rows = tl.program_id(0) * TM + tl.arange(0, TM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok, row_ok = rn < N, rows < M
    acc = tl.zeros([TM, BN], dtype=tl.float32)
    up = acc
    squares = tl.zeros([TM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_off = k0 + rk
        k_ok = k_off < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        wt = tl.trans(tl.load(w_ptr + rn[:, None] * K + k_off[None, :], mask=w_mask, other=0.0))  # [BK, BN]
        a = tl.load(x_ptr + rows[:, None] * K + k_off[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = ordered_dot(a, wt, acc, INTERP)
        if GATED:
            wut = tl.trans(tl.load(w_ptr + (N + rn)[:, None] * K + k_off[None, :], mask=w_mask, other=0.0))
            up = ordered_dot(a, wut, up, INTERP)
        xf = a.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
    scale = tl.rsqrt(squares / K + eps)[:, None]  # [TM, 1]
    acc = acc * scale
    if GATED:
        up = up * scale
        acc = acc * tl.sigmoid(acc) * up
    y = acc.to(w_ptr.dtype.element_ty)
    tl.store(o_ptr + rows[:, None] * N + rn[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


def fold(weight: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """W·diag(g), rounded to W's dtype (done once, at load)."""
    return (weight.float() * norm.float()[None, :]).to(weight.dtype).contiguous()


def folded_linear(x: torch.Tensor, folded: torch.Tensor, gated: bool, processors: int = 132, shared: int = 1 << 18) -> torch.Tensor:
    """RMSNorm(x; g, EPS) @ Wᵀ (SiLU·mul of the halves when gated) with g folded into ``folded``."""
    M, K = x.shape
    N = folded.shape[0] // 2 if gated else folded.shape[0]
    plan = exact_linear_plan(N, K, gated, folded.element_size(), processors)
    _, block_n, stages = exact_linear_launch(plan, M, gated, folded.element_size(), N, processors, shared)
    out = torch.empty((M, N), dtype=folded.dtype, device=x.device)
    grid = (triton.cdiv(M, EXACT_TILE_M), triton.cdiv(N, block_n))
    _folded_kernel[grid](x, folded, out, M, N, K, EPS, GATED=gated, TM=EXACT_TILE_M, BN=block_n, BK=plan.block_k, INTERP=INTERPRETED,
                         num_warps=plan.warps, num_stages=stages)
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor, gated: bool) -> torch.Tensor:
    """fp32 RMSNorm then product (then SiLU·mul), of the unrounded operands."""
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * norm.float()
    y = h @ weight.float().T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate) * up
    return y


# ---------------------------------------------------------------------- --check (CPU interpreter)


def check() -> int:
    """The kernel's arithmetic under Triton's interpreter: close to fp32, rows independent of M."""
    torch.manual_seed(0)
    failures = 0
    for N, K, gated in ((48, 96, False), (40, 80, True), (64, 100, False)):
        weight = (torch.randn(2 * N if gated else N, K) / K**0.5).to(torch.bfloat16)
        norm = (1 + 0.1 * torch.randn(K)).to(torch.bfloat16)
        folded = fold(weight, norm)
        x = (3 * torch.randn(40, K)).to(torch.bfloat16)
        whole = folded_linear(x, folded, gated)
        want = reference(x, weight, norm, gated)
        error = (whole.float() - want).abs().max().item()
        product = (ExactOps().linear(x, weight, norm=norm, eps=EPS, gated=gated).float() - want).abs().max().item()
        bound = 4 * 2.0**-8 * want.abs().max().item()  # two bf16 roundings (W·g, y) and the fp32 sums' order
        same = all(torch.equal(folded_linear(x[:m], folded, gated), whole[:m]) for m in (1, 3, 16))
        ok = error <= bound and same
        failures += not ok
        print(f"N={N} K={K} gated={gated}: max |err| {error:.4g} (the product as it is: {product:.4g}; bound {bound:.4g}), "
              f"rows of M = 1 / 3 / 16 = M = 40: {same} -> {'ok' if ok else 'FAILED'}")
    return 1 if failures else 0


# ---------------------------------------------------------------------- the GPU run


def graph_us(calls, per_graph: int, reps: int) -> float:
    """µs of one call: ``calls()`` (``per_graph`` calls) as one CUDA graph (gpu_graphs' timing: the median replay)."""
    return gg.graph_time(torch.cuda.Stream(), calls, reps) * 1e3 / per_graph


def run_weight(name: str, reps: int) -> list[dict]:
    N, K, gated = WEIGHTS[name]
    rows_out = 2 * N if gated else N
    copies = max(2, -(-STREAMED_BYTES // (rows_out * K * 2)))
    weights = [(torch.randn(rows_out, K, device="cuda") / K**0.5).to(torch.bfloat16) for _ in range(copies)]
    norm = (1 + 0.1 * torch.randn(K, device="cuda")).to(torch.bfloat16)
    folded = [fold(w, norm) for w in weights]
    exact = ExactOps()
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    shared = exact.shared_bytes(torch.device("cuda"))
    results = []
    x64 = (3 * torch.randn(64, K, device="cuda")).to(torch.bfloat16)
    whole = folded_linear(x64, folded[0], gated, processors, shared)
    same = all(torch.equal(folded_linear(x64[:m].clone(), folded[0], gated, processors, shared), whole[:m]) for m in (1, 16))
    want = reference(x64, weights[0], norm, gated)
    product = exact.linear(x64, weights[0], norm=norm, eps=EPS, gated=gated)
    errors = {"product": (product.float() - want).abs().max().item(), "folded": (whole.float() - want).abs().max().item()}
    for M in ROWS:
        x = (3 * torch.randn(M, K, device="cuda")).to(torch.bfloat16)
        normed = exact.rms_norm(x, norm, EPS)
        us = {
            "product": graph_us(lambda: [exact.linear(x, w, norm=norm, eps=EPS, gated=gated) for w in weights], copies, reps),
            "no_norm": graph_us(lambda: [exact.linear(normed, w, gated=gated) for w in weights], copies, reps),
            "folded": graph_us(lambda: [folded_linear(x, f, gated, processors, shared) for f in folded], copies, reps),
        }
        row = {"weight": name, "rows": M, **{f"{k}_us": round(v, 2) for k, v in us.items()}, "rows_invariant": same,
               "product_max_err": round(errors["product"], 5), "folded_max_err": round(errors["folded"], 5)}
        print(f"| {name} | {M} | {row['product_us']} | {row['no_norm_us']} | {row['folded_us']} | {same} "
              f"| {row['product_max_err']} / {row['folded_max_err']} |", flush=True)
        results.append(row)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="the kernel's arithmetic under Triton's interpreter (CPU)")
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.check:
        return check()
    if not torch.cuda.is_available():
        raise SystemExit("the GPU run needs a CUDA GPU (--check runs on the CPU under TRITON_INTERPRET=1)")
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    command = " ".join(["python", "benchmarks/exact_fold.py", *sys.argv[1:]])
    print("| weight | M | norm launch + product µs | product alone µs | folded µs | folded rows = M 64's | max err product / folded |\n"
          "| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    began = time.perf_counter()
    rows = []
    for name in args.weights:
        rows += run_weight(name, args.reps)
        torch.cuda.empty_cache()  # the weight's copies (~1 GiB) go before the next weight's
    summary = {"name": "exact_fold", "date": time.strftime("%Y-%m-%d"), "machine": machine, "command": command,
               "seconds": round(time.perf_counter() - began, 1), "rows": rows}
    if args.record:
        record.append_rows({k: v for k, v in summary.items() if k != "rows"} | row for row in rows)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
