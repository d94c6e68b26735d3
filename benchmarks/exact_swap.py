"""Swapped operands for the exact linear: the weight as the MMA's wide A operand, the rows as its narrow B.

    python benchmarks/exact_swap.py                 # the GPU run: sweep, invariance, comparison (~3-4 min, H200)
    python benchmarks/exact_swap.py --seconds 90 --weights qkv o   # a tighter cap on the sweep, some weights
    python benchmarks/exact_swap.py --dry           # the configurations it would sweep, per weight (no device)
    TRITON_INTERPRET=1 python benchmarks/exact_swap.py --check   # the kernel's arithmetic on the CPU

``exact_ops``' linear puts x in the MMA's A operand (16-row tiles, one row padded to a tile) and W^T in its
B operand, so at M = 1 the MMA's wide side holds 15 padding rows. Here the roles are swapped:
acc [BN, 16] += W [BN, BK] @ x^T [BK, 16], the weight's BN features are the MMA's M side (64 / 128 rows per
wgmma) and 16 rows of x its N side; the result is stored transposed (y[m, n] = acc[n, m]). K is cut into a
split count and a step fixed per weight (``plan.exact_split_k``'s rule), walked in order; with splits > 1
each split's fp32 sums go to a workspace and a second launch adds splits 0..S-1 in order (and the SiLU·mul
of a gated gate|up). Rows beyond 16 only spread: 1, 2 or 4 column tiles of 16 per program (each its own
dot, sharing the weight tile), more on the grid; no row count changes an element's K walk.

The GPU run, per Qwen3-8B weight (gate|up gated [2 x 12288, 4096], q|k|v [6144, 4096], o [4096, 4096],
down [4096, 12288], the LM head [151936, 4096]; random bf16, enough copies of the weight that one CUDA
graph streams >= 256 MiB, past the L2): every configuration (BN, BK, splits, warps; stages by a
shared-memory rule; at most 22) compiled in worker processes (``--compile-seconds``, 120), timed at M = 1,
16 and 64 (CUDA graph, median; timing stops after ``--seconds``, 120, shared by the weights); the one with
the least t1 + t16 + t64 is checked for batch invariance (single rows, 3 rows, 16 rows, a shuffled 64 and a
second 64 bit-identical to the same rows of one M = 64 launch, in bf16 and as unrounded fp32 sums) and
against F.linear / an fp32 product (max |diff|), and compared
with ``ExactOps().linear`` and ``TritonOps().linear`` (one-row GEMV at M = 1, cuBLAS above) on the same
weights. Prints a markdown table (weight, M, µs of each, GB/s of the weight, the config, invariant) and
ends with one JSON line (per weight: the best config, its µs, the exact and fast µs, the best config at
M = 1 alone); ``--record`` appends the rows to benchmarks/results.jsonl; the whole report goes to
``$OUT/exact_swap.json`` when ``OUT`` is set. A failing config is skipped and said so; a failing weight (or
part of one) is recorded, its traceback printed, and the run goes on.

``--check`` (Triton's CPU interpreter, small shapes): the kernel against an fp32 product rounded to bf16
(within one bf16 rounding), and each row of M = 1 / 3 / 16 / a shuffled 40 bit-identical to one M = 40
launch (bf16 and fp32 sums), for plain and gated weights, one split and several, K a multiple of the
step and not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # results.jsonl (benchmarks/ is on the path above)
from dflash_trt.runtime.kernels.exact_ops import INTERPRETED, ordered_dot  # the exact kernels' dot (interpreter-aware)
from dflash_trt.runtime.kernels.plan import exact_split_k  # (splits, K per split) of a weight

TC = 16  # rows of x in one MMA column tile (the MMA's N side); one row is padded to it
SUM_BN = 128  # features per program of the split sum (elementwise: any tile gives the same bits)
STAGE_BYTES = 160 * 1024  # shared memory the pipelined K steps may hold (the stage rule)
SMEM_BYTES = 220 * 1024  # a config whose two stages at four column tiles exceed this is not swept
ROWS = (1, 16, 64)
WEIGHTS = {  # name -> (N, K, gated): the Qwen3-8B step's weights (gated: W is [gate; up], [2N, K])
    "gate_up": (12288, 4096, True),
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "down": (4096, 12288, False),
    "lm_head": (151936, 4096, False),
}
STREAM_BYTES = 256 * 1024**2  # weight bytes one timed graph streams, at least (the H200's L2 is 50 MB)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _column_product(x_ptr, stride_xm, cols, k_off, k_ok, M, w, wu, acc, acc_u, GATED: tl.constexpr,
                    INTERP: tl.constexpr):
    """One column tile (TC rows of x), one K step: acc [BN, TC] += w [BN, BK] @ x^T [BK, TC] (and the up half)."""
    mask = (cols < M)[:, None] & k_ok[None, :]
    xt = tl.trans(tl.load(x_ptr + cols[:, None] * stride_xm + k_off[None, :], mask=mask, other=0.0))  # [BK, TC]
    acc = ordered_dot(w, xt, acc, INTERP)
    if GATED:
        acc_u = ordered_dot(wu, xt, acc_u, INTERP)
    return acc, acc_u


@triton.jit
def _column_store(acc, acc_u, cols, rn, n_ok, M, o_ptr, stride_om, GATED: tl.constexpr):
    """y[m, n] = act(acc[n, m]) rounded to the output dtype (bf16): the transpose happens in the addresses."""
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_u  # silu(gate) * up in fp32, as exact_ops' epilogue
    mask = n_ok[:, None] & (cols < M)[None, :]
    tl.store(o_ptr + cols[None, :] * stride_om + rn[:, None], acc.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _column_partial(acc, acc_u, cols, rn, n_ok, M, ws_ptr, WR, N, s, GATED: tl.constexpr):
    """Split s's fp32 sums into the workspace [SPLITS, WR, C] (C = 2N gated: gate | up), row m at column m."""
    C = 2 * N if GATED else N
    mask = n_ok[:, None] & (cols < M)[None, :]
    part = ws_ptr + s * WR * C + cols[None, :] * C + rn[:, None]  # [BN, TC]
    tl.store(part, acc, mask=mask)
    if GATED:
        tl.store(part + N, acc_u, mask=mask)


@triton.jit(do_not_specialize=["M", "WR"])  # row counts: one compiled kernel whatever M is (M = 1 included)
def _swap_linear_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, o_ptr, stride_om, ws_ptr, WR, M, N, K, KS,
    GATED: tl.constexpr, SPLITS: tl.constexpr, CT: tl.constexpr, TC: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, INTERP: tl.constexpr,
):
    """Program (BN features, K split s = [s KS, s KS + KS), CT column tiles of TC rows): the weight tile
    [BN, BK] is the A operand of each tile's dot, x^T [BK, TC] the B operand; every element walks its split
    in BK steps from the split's start, whatever M or CT is. SPLITS == 1: stored (and gated) here; else the
    split's sums go to the workspace and ``_swap_sum_kernel`` adds them in order."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    s = tl.program_id(1)
    cols = tl.program_id(2) * (CT * TC) + tl.arange(0, TC)
    n_ok = rn < N
    rk = tl.arange(0, BK)
    acc0 = tl.zeros([BN, TC], dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    up0, up1, up2, up3 = acc0, acc0, acc0, acc0  # the up halves (GATED)
    for k0 in range(s * KS, tl.minimum(s * KS + KS, K), BK):  # KS: a multiple of BK, so only K cuts a step
        k_off = k0 + rk
        k_ok = k_off < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + rn[:, None] * stride_wn + k_off[None, :], mask=w_mask, other=0.0)  # [BN, BK]
        if GATED:
            wu = tl.load(w_ptr + (N + rn)[:, None] * stride_wn + k_off[None, :], mask=w_mask, other=0.0)
        else:
            wu = w  # unread
        acc0, up0 = _column_product(x_ptr, stride_xm, cols, k_off, k_ok, M, w, wu, acc0, up0, GATED, INTERP)
        if CT > 1:
            acc1, up1 = _column_product(x_ptr, stride_xm, cols + TC, k_off, k_ok, M, w, wu, acc1, up1, GATED, INTERP)
        if CT > 2:
            acc2, up2 = _column_product(x_ptr, stride_xm, cols + 2 * TC, k_off, k_ok, M, w, wu, acc2, up2, GATED, INTERP)
            acc3, up3 = _column_product(x_ptr, stride_xm, cols + 3 * TC, k_off, k_ok, M, w, wu, acc3, up3, GATED, INTERP)
    if SPLITS == 1:
        _column_store(acc0, up0, cols, rn, n_ok, M, o_ptr, stride_om, GATED)
        if CT > 1:
            _column_store(acc1, up1, cols + TC, rn, n_ok, M, o_ptr, stride_om, GATED)
        if CT > 2:
            _column_store(acc2, up2, cols + 2 * TC, rn, n_ok, M, o_ptr, stride_om, GATED)
            _column_store(acc3, up3, cols + 3 * TC, rn, n_ok, M, o_ptr, stride_om, GATED)
    else:
        _column_partial(acc0, up0, cols, rn, n_ok, M, ws_ptr, WR, N, s, GATED)
        if CT > 1:
            _column_partial(acc1, up1, cols + TC, rn, n_ok, M, ws_ptr, WR, N, s, GATED)
        if CT > 2:
            _column_partial(acc2, up2, cols + 2 * TC, rn, n_ok, M, ws_ptr, WR, N, s, GATED)
            _column_partial(acc3, up3, cols + 3 * TC, rn, n_ok, M, ws_ptr, WR, N, s, GATED)


@triton.jit(do_not_specialize=["M", "WR"])
def _swap_sum_kernel(ws_ptr, WR, o_ptr, stride_om, M, N, GATED: tl.constexpr, SPLITS: tl.constexpr, TC: tl.constexpr,
                     BN: tl.constexpr):
    """Program (BN features, TC rows): the splits' fp32 sums added in order 0, 1, .., SPLITS - 1, then stored
    (gated: silu(gate) * up). Loads bypass L1 (".cg"): other programs wrote the workspace."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * TC + tl.arange(0, TC)
    n_ok = rn < N
    mask = n_ok[:, None] & (cols < M)[None, :]
    C = 2 * N if GATED else N
    acc = tl.zeros([BN, TC], dtype=tl.float32)
    acc_u = acc
    for s in tl.static_range(SPLITS):
        part = ws_ptr + s * WR * C + cols[None, :] * C + rn[:, None]
        acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        if GATED:
            acc_u += tl.load(part + N, mask=mask, other=0.0, cache_modifier=".cg")
    _column_store(acc, acc_u, cols, rn, n_ok, M, o_ptr, stride_om, GATED)


# --------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class SwapConfig:
    """One weight's tiling: ``block_n`` features per program (the MMA's M side), ``block_k`` K step and
    ``splits`` (how a row is summed), ``warps``, ``stages`` (0: ``stages_for``'s shared-memory rule).
    ``wide``: more than 16 rows go in ONE dot of 32 / 64 columns instead of 2 / 4 dots of 16 (the MMA's N
    side then follows M: whether that keeps the bits is what the GPU run checks)."""

    block_n: int
    block_k: int
    splits: int
    warps: int = 4
    stages: int = 0
    wide: bool = False

    def label(self) -> str:
        return (f"BN{self.block_n}/BK{self.block_k}/S{self.splits}/w{self.warps}" + (f"/st{self.stages}" if self.stages else "")
                + ("/wide" if self.wide else ""))

    def fields(self) -> list:
        return [self.block_n, self.block_k, self.splits, self.warps, self.stages, self.wide]


def column_tiles(rows: int) -> int:
    """16-row column tiles per program (1, 2 or 4) for ``rows`` rows: how many share each weight tile; spread only."""
    return 1 if rows <= TC else 2 if rows <= 2 * TC else 4


def stage_bytes(config: SwapConfig, tiles: int, gated: bool) -> int:
    """Shared memory of one pipelined K step: the weight tile(s) [BN, BK] and the x tiles [tiles * TC, BK], bf16."""
    return ((2 if gated else 1) * config.block_n + tiles * TC) * config.block_k * 2


def stages_for(config: SwapConfig, tiles: int, gated: bool) -> int:
    """The config's stages, else as many as fit ``STAGE_BYTES`` (2 to 4)."""
    return config.stages or max(2, min(4, STAGE_BYTES // stage_bytes(config, tiles, gated)))


class SwapLinear:
    """y [M, N] = x @ W.T (gated: silu(x @ gate.T) * (x @ up.T)) with one config; the split workspace is
    allocated once per (rows, columns, device), on the first (eager) call, so CUDA graphs keep its address."""

    def __init__(self, config: SwapConfig) -> None:
        self.config = config
        self._workspaces: dict[tuple, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, gated: bool = False, out_dtype=None) -> torch.Tensor:
        """``out_dtype`` float32: the fp32 sums unrounded (the checks: an order change shows in every element)."""
        cfg = self.config
        M, K = x.shape
        N = weight.shape[0] // 2 if gated else weight.shape[0]
        if x.stride(1) != 1 or x.stride(0) != K or x.data_ptr() % 16:
            x = x.clone(memory_format=torch.contiguous_format)  # one x layout (and vectorization) for every call
        splits, width = exact_split_k(K, cfg)
        tiles = column_tiles(M)
        out = torch.empty((M, N), dtype=out_dtype or weight.dtype, device=x.device)
        ws = self._workspace(splits, M, 2 * N if gated else N, x.device) if splits > 1 else out  # unread with one split
        grid = (triton.cdiv(N, cfg.block_n), splits, triton.cdiv(M, tiles * TC))
        dots, columns = (1, tiles * TC) if cfg.wide else (tiles, TC)  # per program: dots x columns each
        _swap_linear_kernel[grid](
            x, x.stride(0), weight, weight.stride(0), out, out.stride(0), ws, M, M, N, K, width,
            GATED=gated, SPLITS=splits, CT=dots, TC=columns, BN=cfg.block_n, BK=cfg.block_k, INTERP=INTERPRETED,
            num_warps=cfg.warps, num_stages=stages_for(cfg, tiles, gated),
        )
        if splits > 1:
            _swap_sum_kernel[(triton.cdiv(N, SUM_BN), triton.cdiv(M, TC))](
                ws, M, out, out.stride(0), M, N, GATED=gated, SPLITS=splits, TC=TC, BN=SUM_BN, num_warps=4,
            )
        return out

    def _workspace(self, splits: int, rows: int, columns: int, device) -> torch.Tensor:
        key = (splits, rows, columns, str(device))
        if key not in self._workspaces:
            self._workspaces[key] = torch.empty(splits * rows * columns, dtype=torch.float32, device=device)
        return self._workspaces[key]


def reference(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
    """The fp32 product (and fp32 SiLU·mul), unrounded: [M, N] fp32."""
    y = x.float() @ weight.float().T
    if gated:
        N = weight.shape[0] // 2
        y = torch.nn.functional.silu(y[:, :N]) * y[:, N:]
    return y


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# --------------------------------------------------------------------------- the CPU check


CHECK_CASES = (  # (N, K, gated, config): plain and gated, one split and several, K cut inside a step (320 by 128)
    (96, 256, False, SwapConfig(64, 64, 1)),
    (96, 256, False, SwapConfig(64, 64, 2)),
    (96, 320, False, SwapConfig(128, 128, 2)),
    (48, 256, True, SwapConfig(64, 64, 1)),
    (48, 256, True, SwapConfig(64, 128, 2)),
    (96, 256, False, SwapConfig(64, 64, 2, wide=True)),
    (48, 256, True, SwapConfig(64, 64, 1, wide=True)),
)
CHECK_ROWS = 40


def row_parts(total: int, device, generator=None) -> list[tuple[torch.Tensor, str]]:
    """(rows, label) launched alone against one launch on all ``total`` rows: single rows (first, middle, last),
    three rows, 16 rows off a tile boundary, all of them shuffled, all of them again (a race)."""
    arange = lambda a, b: torch.arange(a, b, device=device)
    parts = [(arange(r, r + 1), f"M=1 row {r}") for r in (0, 17, total - 1)]
    parts += [(arange(5, 8), "M=3 rows 5..7"), (arange(20, 36), "M=16 rows 20..35")]
    perm = torch.randperm(total, generator=generator).to(device)
    return parts + [(perm, f"M={total} shuffled"), (arange(0, total), f"M={total} again")]


def differing_rows(swap: SwapLinear, x, weight, gated: bool, parts: list, out_dtype=None) -> list[str]:
    """Labels of ``parts`` whose rows launched alone differ in bits from the same rows of one launch on all of x."""
    full = swap(x, weight, gated, out_dtype)
    return [what for rows, what in parts if not same_bits(swap(x[rows].contiguous(), weight, gated, out_dtype), full[rows])]


def check_case(N: int, K: int, gated: bool, config: SwapConfig) -> list[str]:
    """Problems of one case (empty: passed): M = 40 within one bf16 rounding of fp32, and the rows of M = 1 / 3 /
    16 / a shuffled 40 bit-identical to the M = 40 launch's, in bf16 and as unrounded fp32 sums (a changed
    summing order shows in most fp32 elements, in few of their bf16 roundings)."""
    generator = torch.Generator().manual_seed(N * K + gated)
    x = torch.randn(CHECK_ROWS, K, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(2 * N if gated else N, K, generator=generator) * 0.05).to(torch.bfloat16)
    swap = SwapLinear(config)
    full, ref = swap(x, weight, gated), reference(x, weight, gated)
    problems = []
    # fp32 sums in another order, each rounded to bf16 once: within one bf16 ulp (2^-8 relative) plus slack.
    if ((full.float() - ref).abs() - (2**-7 * ref.abs() + 1e-3)).max() > 0:
        problems.append(f"M={CHECK_ROWS} off the fp32 product by {float((full.float() - ref).abs().max()):.3e}")
    parts = row_parts(CHECK_ROWS, "cpu", generator)
    problems += [f"{what} differ (bf16)" for what in differing_rows(swap, x, weight, gated, parts)]
    problems += [f"{what} differ (fp32 sums)" for what in differing_rows(swap, x, weight, gated, parts, torch.float32)]
    return problems


def run_check() -> int:
    if not INTERPRETED:
        print("--check runs under Triton's CPU interpreter: TRITON_INTERPRET=1 python benchmarks/exact_swap.py --check")
        return 2
    failed = 0
    for N, K, gated, config in CHECK_CASES:
        problems = check_case(N, K, gated, config)
        failed += bool(problems)
        verdict = "; ".join(problems) if problems else "ok (near fp32; rows of M=1/3/16/shuffled 40 bit-identical to M=40, bf16 and fp32 sums)"
        print(f"check N={N} K={K} gated={gated} {config.label()}: {verdict}", flush=True)
    print(json.dumps({"name": "exact_swap_check", "cases": len(CHECK_CASES), "failed": failed}))
    return 1 if failed else 0


# --------------------------------------------------------------------------- the sweep (GPU)


def configs(N: int, K: int, gated: bool) -> tuple[list[SwapConfig], list[str]]:
    """(configs to sweep, those left out and why): BN 128 / 64 x BK 128 / 256 / 64 x splits 1 / 2 / 4 at 4 warps,
    + 8 warps for BN 128 x BK 128 / 256 x splits 1 / 2; splits only where each has >= 2 K steps, none for the LM
    head (its N fills the machine); two stages at four column tiles must fit the shared memory."""
    wide = N >= 65536
    candidates = []
    for block_n in (128, 64):
        for block_k in (128, 256, 64):
            candidates += [SwapConfig(block_n, block_k, s) for s in ((1,) if wide else (1, 2, 4)) if s == 1 or K // (s * block_k) >= 2]
    for block_k in (128, 256):
        candidates += [SwapConfig(128, block_k, s, 8) for s in ((1,) if wide else (1, 2))]
    kept, dropped = [], []
    for config in candidates:
        if 2 * stage_bytes(config, 4, gated) > SMEM_BYTES:
            dropped.append(f"{config.label()}: two stages at M=64 need {2 * stage_bytes(config, 4, gated) // 1024} KiB shared memory")
        else:
            kept.append(config)
    return kept, dropped


def print_dry() -> int:
    """The configs per weight with their splits (K per split) and stages at 1 / 4 column tiles."""
    for name, (N, K, gated) in WEIGHTS.items():
        kept, dropped = configs(N, K, gated)
        print(f"{name} N={N} K={K} gated={gated}: {len(kept)} configs, {weight_copies(N, K, gated)} weight copies per graph")
        for c in kept:
            splits, width = exact_split_k(K, c)
            print(f"  {c.label():24s} splits {splits} x K {width}, stages {stages_for(c, 1, gated)} (M<=16) "
                  f"{stages_for(c, 4, gated)} (M=64)")
        for line in dropped:
            print(f"  left out {line}")
    return 0


def weight_copies(N: int, K: int, gated: bool) -> int:
    """Copies of a weight one timed graph walks through so it streams >= STREAM_BYTES (at most 8)."""
    return max(1, min(8, math.ceil(STREAM_BYTES / ((2 if gated else 1) * N * K * 2))))


def _compile_job(job) -> str:
    """Worker process: one launch on zeros so Triton compiles (weight, config, M) into its disk cache."""
    name, fields, M = job
    try:
        N, K, gated = WEIGHTS[name]
        weight = torch.zeros((2 * N if gated else N, K), dtype=torch.bfloat16, device="cuda")
        SwapLinear(SwapConfig(*fields))(torch.zeros(M, K, dtype=torch.bfloat16, device="cuda"), weight, gated)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - recorded; the config is skipped later
        return f"{name} {SwapConfig(*fields).label()} M={M}: {error!r}"[:400]


def compile_all(names: list[str], timeout_s: float) -> tuple[float, dict]:
    """Every (weight, config) at M = 1 and 64 (the kernels M = 1 / 16 / 64 launch) compiled in parallel worker
    processes sharing Triton's disk cache; returns (seconds, {(name, config fields): error})."""
    import multiprocessing

    jobs = [(n, c.fields(), m) for n in names for c in configs(*WEIGHTS[n])[0] for m in (1, 64)]
    began = time.perf_counter()
    workers = max(1, min(14, (os.cpu_count() or 2) - 2))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        errors = pool.map_async(_compile_job, jobs, chunksize=1).get(timeout=timeout_s)  # past it: TimeoutError
    failed = {(n, tuple(f)): e for (n, f, _), e in zip(jobs, errors) if e}
    return time.perf_counter() - began, failed


def graph_us(stream, call, weights: list, reps: int) -> float:
    """µs per call of ``call(w)``: one CUDA graph calls it on each copy of the weight (``gpu_graphs.graph_time``)."""
    import gpu_graphs

    return gpu_graphs.graph_time(stream, lambda: [call(w) for w in weights], reps) * 1e3 / len(weights)


@dataclass
class WeightBench:
    """One weight's copies on the device, its inputs per M and the timing stream."""

    name: str
    N: int
    K: int
    gated: bool
    weights: list
    xs: dict
    stream: object
    reps: int

    @classmethod
    def make(cls, name: str, reps: int, device: str = "cuda") -> WeightBench:
        N, K, gated = WEIGHTS[name]
        generator = torch.Generator(device=device).manual_seed(N + K)
        rows = 2 * N if gated else N
        weights = [(torch.randn(rows, K, device=device, generator=generator) * 0.02).to(torch.bfloat16)
                   for _ in range(weight_copies(N, K, gated))]
        xs = {M: torch.randn(M, K, device=device, generator=generator).to(torch.bfloat16) for M in ROWS}
        if device != "cuda":
            return cls(name, N, K, gated, weights, xs, None, reps)
        torch.cuda.synchronize()  # made on the default stream, read on the timing stream
        return cls(name, N, K, gated, weights, xs, torch.cuda.Stream(), reps)

    def time(self, linear, M: int) -> float:
        """µs per call of ``linear(x, w, gated)`` at M rows."""
        x = self.xs[M]
        return graph_us(self.stream, lambda w: linear(x, w, self.gated), self.weights, self.reps)

    def weight_bytes(self) -> int:
        return self.weights[0].numel() * self.weights[0].element_size()


def sweep_weight(bench: WeightBench, failed: dict, deadline: float) -> tuple[list[dict], list[str]]:
    """Each config timed at M = 1, 16, 64 (the compile failures skipped, said so); stops at ``deadline``."""
    rows, notes = [], []
    for config in configs(bench.N, bench.K, bench.gated)[0]:
        if (bench.name, tuple(config.fields())) in failed:
            notes.append(f"skipped {config.label()}: {failed[(bench.name, tuple(config.fields()))]}")
            continue
        if time.perf_counter() > deadline:
            notes.append(f"not timed (past --seconds) {config.label()}")
            continue
        swap = SwapLinear(config)
        try:
            times = {M: bench.time(swap, M) for M in ROWS}
        except Exception as error:  # noqa: BLE001 - one failing config never ends the sweep
            notes.append(f"failed {config.label()}: {error!r}"[:400])
            continue
        rows.append({"config": config.fields(), "label": config.label(), **{f"us_m{M}": round(t, 2) for M, t in times.items()}})
        print(f"  {bench.name:8s} {config.label():24s} " + "  ".join(f"M={M} {t:7.1f} us" for M, t in times.items()), flush=True)
    for note in notes:
        print(f"  {bench.name:8s} {note}", flush=True)
    return rows, notes


def invariance(bench: WeightBench, swap: SwapLinear) -> dict:
    """``row_parts``' rows of M = 64 (single rows, 3, 16, shuffled, again) launched alone against one M = 64
    launch, in bf16 and as fp32 sums; max |diff| of M = 64 against F.linear (bf16, cuBLAS) and fp32."""
    x, weight, gated = bench.xs[64], bench.weights[0], bench.gated
    with torch.cuda.stream(bench.stream):  # None (a CPU rehearsal): no stream
        parts = row_parts(64, x.device)
        differ = [f"{what} (bf16)" for what in differing_rows(swap, x, weight, gated, parts)]
        differ += [f"{what} (fp32 sums)" for what in differing_rows(swap, x, weight, gated, parts, torch.float32)]
        full = swap(x, weight, gated)
        linear = torch.nn.functional.linear(x, weight)
        if gated:
            linear = (torch.nn.functional.silu(linear[:, :bench.N].float()) * linear[:, bench.N:].float()).to(torch.bfloat16)
        ref = reference(x, weight, gated)
        if bench.stream is not None:
            bench.stream.synchronize()
    return {"invariant": not differ, "differ": differ, "max_abs_vs_linear": float((full.float() - linear.float()).abs().max()),
            "max_abs_vs_fp32": float((full.float() - ref).abs().max()), "max_abs_ref": float(ref.abs().max())}


def wide_twin(bench: WeightBench, config: SwapConfig) -> dict:
    """The best config with one dot of 64 columns at M = 64 (``wide``; M <= 16 is the same kernel): its µs at
    M = 64 and whether its rows still equal the launches of fewer rows."""
    swap = SwapLinear(SwapConfig(*config.fields()[:5], wide=True))
    twin = {"us_m64": round(bench.time(swap, 64), 2)} | invariance(bench, swap)
    print(f"  {bench.name:8s} wide twin {swap.config.label()}: M=64 {twin['us_m64']:.1f} us, invariant {twin['invariant']} "
          f"{twin['differ']}", flush=True)
    return {"wide": twin}


def compare(bench: WeightBench) -> dict:
    """µs per call of the current exact kernel and the fast path (GEMV at M = 1, cuBLAS above), per M."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    exact, fast = ExactOps(), TritonOps()
    out = {}
    for label, ops in (("exact", exact), ("fast", fast)):
        for M in ROWS:
            out[f"{label}_us_m{M}"] = round(bench.time(lambda x, w, g: ops.linear(x, w, gated=g), M), 2)  # noqa: B023
    return out


def weight_section(name: str, args, failed: dict, deadline: float) -> dict:
    """One weight: sweep, the best config (least t1 + t16 + t64), its invariance, the comparison; a failing
    part is recorded in ``errors`` (traceback printed) and the others still run."""
    bench = WeightBench.make(name, args.reps)
    result = {"weight": name, "N": bench.N, "K": bench.K, "gated": bench.gated, "copies": len(bench.weights),
              "weight_bytes": bench.weight_bytes(), "errors": {}}
    try:
        result["sweep"], result["notes"] = sweep_weight(bench, failed, deadline)
        if result["sweep"]:
            best = min(result["sweep"], key=lambda r: sum(r[f"us_m{M}"] for M in ROWS))
            result["best"], result["best_m1"] = best, min(result["sweep"], key=lambda r: r["us_m1"])
            result |= _part(result, "invariance", lambda: invariance(bench, SwapLinear(SwapConfig(*best["config"]))))
            if "invariant" in result:
                print(f"  {name:8s} BEST {best['label']}: invariant {result['invariant']} {result['differ']}, max |diff| vs "
                      f"F.linear {result['max_abs_vs_linear']:.3e}, vs fp32 {result['max_abs_vs_fp32']:.3e}", flush=True)
            result |= _part(result, "wide", lambda: wide_twin(bench, SwapConfig(*best["config"])))
            if result["best_m1"] is not best:  # the fastest at M = 1 alone: is it invariant too
                check = _part(result, "best_m1", lambda: invariance(bench, SwapLinear(SwapConfig(*result["best_m1"]["config"]))))
                result["best_m1"] |= {k: check[k] for k in ("invariant", "differ") if k in check}
        result |= _part(result, "compare", lambda: compare(bench))
        return result
    finally:
        bench.weights.clear()  # the copies (up to 1.2 GB) freed before the next weight's
        bench.xs.clear()
        torch.cuda.empty_cache()


def _part(result: dict, label: str, run) -> dict:
    """``run()``'s dict, or {} with the traceback kept in result["errors"][label] (and printed)."""
    try:
        return run()
    except Exception:  # noqa: BLE001 - recorded; the rest of the weight's section runs
        result["errors"][label] = traceback.format_exc()
        print(f"  {result['weight']} {label} FAILED:\n{result['errors'][label]}", flush=True)
        return {}


# --------------------------------------------------------------------------- report


def table_rows(results: list[dict]) -> list[dict]:
    """One row per (weight, M): the best swap config's µs, the exact and fast µs, GB/s of the weight."""
    rows = []
    for r in results:
        for M in ROWS:
            swap = r["best"][f"us_m{M}"] if r.get("best") else None
            row = {"weight": r["weight"], "rows": M, "swap_us": swap, "exact_us": r.get(f"exact_us_m{M}"),
                   "fast_us": r.get(f"fast_us_m{M}"), "swap_config": r["best"]["label"] if r.get("best") else None,
                   "invariant": r.get("invariant")}
            for label in ("swap", "exact", "fast"):
                us = row[f"{label}_us"]
                row[f"{label}_gbps"] = round(r["weight_bytes"] / us / 1e3, 1) if us else None
            rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| weight | M | swap µs | exact µs | fast µs | GB/s swap / exact / fast | swap config | invariant |",
             "|" + " --- |" * 8]
    for r in rows:
        invariant = {True: "yes", False: "NO", None: "-"}[r["invariant"]]
        lines.append(f"| {r['weight']} | {r['rows']} | {r['swap_us']} | {r['exact_us']} | {r['fast_us']} | "
                     f"{r['swap_gbps']} / {r['exact_gbps']} / {r['fast_gbps']} | {r['swap_config']} | {invariant} |")
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="the CPU check (needs TRITON_INTERPRET=1)")
    parser.add_argument("--dry", action="store_true", help="list the configs per weight and exit (no device)")
    parser.add_argument("--seconds", type=float, default=120.0, help="the sweep's timing stops after this long (split over weights)")
    parser.add_argument("--compile-seconds", type=float, default=120.0,
                        help="the parallel compile gives up after this long (the sweep then compiles as it goes)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results.jsonl")
    return parser.parse_args()


def run_gpu(args) -> int:
    began = time.perf_counter()
    machine = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, triton {triton.__version__})"
    command = "python benchmarks/exact_swap.py " + " ".join(sys.argv[1:])
    report = {"name": "exact_swap", "machine": machine, "command": command, "results": [], "failures": {}}
    try:
        seconds, failed = compile_all(args.weights, args.compile_seconds)
        print(f"compiled in {seconds:.0f} s ({len(failed)} (weight, config) failed)", flush=True)
    except Exception:  # noqa: BLE001 - then each config compiles on its first timed call (within --seconds)
        failed = {}
        report["failures"]["compile_all"] = traceback.format_exc()
        print(traceback.format_exc(), flush=True)
    report["compile_failures"] = {f"{n} {SwapConfig(*f).label()}": e for (n, f), e in failed.items()}
    start = time.perf_counter()
    for i, name in enumerate(args.weights):
        deadline = start + args.seconds * (i + 1) / len(args.weights)  # an equal share of the cap per weight
        try:
            result = weight_section(name, args, failed, deadline)
            report["results"].append(result)
            report["failures"] |= {f"{name} {part}": error for part, error in result["errors"].items()}
        except Exception:  # noqa: BLE001 - recorded; the next weight runs
            report["failures"][name] = traceback.format_exc()
            print(f"{name} FAILED:\n{report['failures'][name]}", flush=True)
    return finish(report, args, began)


def finish(report: dict, args, began: float) -> int:
    rows = table_rows(report["results"])
    report["table"] = rows
    report["seconds"] = round(time.perf_counter() - began, 1)
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "exact_swap.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n" + markdown(rows), flush=True)
    if args.record:
        record.append_rows({"name": "exact_swap", "date": date, "machine": report["machine"], "command": report["command"], **r}
                           for r in rows)
    summary = {"name": "exact_swap", "date": date, "machine": report["machine"], "seconds": report["seconds"],
               "failures": sorted(report["failures"]),
               "best": {r["weight"]: {"config": r["best"]["label"], "invariant": r.get("invariant"),
                                      **{k: v for k, v in r["best"].items() if k.startswith("us_m")},
                                      **{k: v for k, v in r.items() if k.startswith(("exact_us", "fast_us"))},
                                      "best_m1": [r["best_m1"]["label"], r["best_m1"]["us_m1"]],
                                      "wide_m64": [r["wide"]["us_m64"], r["wide"]["invariant"]] if r.get("wide") else None}
                        for r in report["results"] if r.get("best")}}
    record.finish(summary, args.record)
    return 1 if report["failures"] else 0


def main() -> int:
    args = arguments()
    if args.check:
        return run_check()
    if args.dry:
        return print_dry()
    if not torch.cuda.is_available():
        print("the GPU run needs a CUDA device (--check runs on the CPU, --dry lists the configs)")
        return 2
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
