"""Exact kernels: every row's result is the same bits whatever else shares the launch (CUDA, Triton).

``ExactOps`` has ``TritonOps``' interface (``linear`` / ``rms_norm`` / ``silu_mul`` / ``qk_rope_write`` /
``attention``, with ``rows`` and ``lengths``) and one rule: the arithmetic that produces a row never
depends on how many rows, queries, owners or cache slots the launch has. Then a verify row of DFlash
(16 rows per owner, n owners) and the same position decoded alone (one row) give the same logits, bit
for bit, in bf16 too, so DFlash's output is the target's own plain decoding, token for token.

==================  ===================================================================================
``linear``          one ``tl.dot`` kernel for every M: rows in 16-row MMA tiles (one row is padded to a
                    tile), K cut into a split count fixed PER WEIGHT (``plan.exact_linear_plan``: from N,
                    K and the processor count, never M; an H200 table from the sweep), each split walked
                    from its start in steps fixed per weight, fp32 accumulate. One split: bias, SiLU·mul,
                    residual and tap are epilogues of that kernel; more: each split's sums go to an fp32
                    workspace [splits, rows, N] (allocated once per stream) and a second pass adds splits
                    0..S-1 in order, then runs the same epilogues. An RMSNorm before the product is its own
                    row-local pass first (``TritonOps.rms_norm``: one program per row, the whole row in one
                    block, nothing chosen from M): inside the K loop, as it was, it kept Triton from
                    pipelining the weight's loads (Qwen3-8B gate|up on an H200: 85.6 µs at M = 1 and
                    158.9 at M = 64 with it, 49.8 and 55.2 without); made instead by the previous
                    product's last program per row block it saved nothing (8B step 4.913 vs 4.918 ms:
                    benchmarks/RESULTS.md, "a norm hand-off tried and reverted"). How the work is spread may follow M
                    (``plan.exact_linear_launch``: up to four tiles share each weight load, wider feature
                    blocks for many rows, fewer tiles and narrower blocks where a small weight would leave
                    most processors idle, rows per launch that fit the workspace; pipelines, tiles and
                    blocks that fit the GPU's shared memory per program, ``ExactOps.shared_bytes``): each
                    tile's dot walks the same K steps whatever M is, so that choice changes speed only.
                    On an sm90 GPU a program's four 16-row tiles run as one 64-row tile (``wide_tiles``:
                    Hopper's warp-group MMA, the same K steps; its bits equal the 16-row MMA's by
                    measurement, not by contract: the gpu-marked ``wide_rows`` check).
                    An fp8 weight (``scale=``: a draft's, ``kernels.quant``) is widened to x's dtype as
                    each K step is loaded, its scale applied per feature in the epilogue; the same rules.
``attention``       keys split at a fixed size (``EXACT_SPLIT_SLOTS``): split s covers slots
                    [256 s, 256 s + 256) of the valid range, walked in BLOCK_N steps at absolute slots;
                    the grid covers a full cache and splits past the valid slots do nothing; the
                    combine (``_combine_unit``: a second launch, or the unit's last split to finish)
                    folds the splits in increasing order (in the launch, a unit with one live split
                    stores its partial: the fold's result to the bit, without its round trips). A query's
                    splits, steps and combine do not depend on the other queries of its tile (their
                    extra steps are exact no-ops for it), the query count, the owners or the capacity.
``qk_rope_write``   ``TritonOps``' kernel: one program per (row, head), already row-local.
==================  ===================================================================================

Identical results need identical compiled arithmetic: every row of a kind goes through one kernel whose
summing tiles (the K split, the K step and the 16-row MMA tile of the linear, the split window and BLOCK_N of
attention) are never chosen from a row, query, owner or slot count; the integer arguments that follow
those counts are not specialized on; x is passed 16-byte aligned with row stride K (Triton vectorizes a
load, and so orders the reductions over it, by the pointer's alignment). Per layer shape a few variants
compile (tiles per program, feature block: how work is spread), the same arithmetic in each
(tests/runtime/test_exact_kernels.py compares their sm90 IR: ``mma.sync`` 16 x 8, the warp-group MMA for wide
tiles).
Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CPU tests) the dots are written out as fp32
products summed over K in order (``ordered_dot``): the interpreter multiplies bf16 as raw integers, and numpy's
BLAS rounds a row differently by its place in the tile; everything else is the GPU's code.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash_trt.runtime.kernels.plan import (
    EXACT_BLOCK_Q,
    EXACT_PARTIAL_BYTES,
    EXACT_SHARED_BYTES,
    EXACT_SHARED_HEADROOM,
    EXACT_SPLIT_SLOTS,
    EXACT_TILE_M,
    EXACT_WORKSPACE_BYTES,
    ExactLinearPlan,
    exact_attention_block_n,
    exact_attention_launch,
    exact_attention_stages,
    exact_linear_launch,
    exact_linear_plan,
    exact_split_count,
    exact_split_k,
    exact_units_per_launch,
    exact_workspace_rows,
)
from dflash_trt.runtime.kernels.quant import FP8
from dflash_trt.runtime.kernels.triton_ops import MASKED, TritonOps, enter, query_tile, release

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read by triton.jit at import, as here
EXACT_SUM_BLOCK_N = 256  # features per program of the split-K sum (elementwise: any tile gives the same bits)
EXACT_COUNTERS = 1 << 16  # tile / unit counters of the in-kernel sums, at least (the 8B LM head at 64 rows: 38k)


# --------------------------------------------------------------------------- linear


@triton.jit
def ordered_dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b (fp32). INTERP (Triton's CPU interpreter): operands widened to fp32 (it multiplies bf16 as
    raw integers) and each element summed over K in order, as a GPU's MMA does: numpy's BLAS rounds a row
    differently by its place in the tile, which the GPU does not."""
    if INTERP:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _tile_product(x_ptr, stride_xm, rows, k_off, k_ok, M, wt, wut, acc, acc_u, WTYPE: tl.constexpr, GATED: tl.constexpr,
                  INTERP: tl.constexpr):
    """One tile (16 rows, or 64 with ``wide_tiles``), one K step: acc [TM, BN] += x [TM, BK] @ wt [BK, BN] (and the up half)."""
    mask = (rows < M)[:, None] & k_ok[None, :]
    a = tl.load(x_ptr + rows[:, None] * stride_xm + k_off[None, :], mask=mask, other=0.0).to(WTYPE)
    acc = ordered_dot(a, wt, acc, INTERP)
    if GATED:
        acc_u = ordered_dot(a, wut, acc_u, INTERP)
    return acc, acc_u


@triton.jit
def _tile_epilogue(acc, acc_u, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr,
                   stride_tm, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, TAP: tl.constexpr,
                   SCALED: tl.constexpr):
    """y = residual + act(acc * scale + bias), rounded to the weight dtype (SCALED, an fp8 weight: x's), stored
    (and tapped)."""
    if SCALED:  # the fp8 weight's scale per feature (``kernels.quant``)
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_u = acc_u * tl.load(s_ptr + N + rn, mask=n_ok, other=0.0)[None, :]
    if BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_u
    mask = (rows < M)[:, None] & n_ok[None, :]
    if RESIDUAL:
        acc += tl.load(r_ptr + rows[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        y = acc.to(x_ptr.dtype.element_ty)
    else:
        y = acc.to(w_ptr.dtype.element_ty)  # rounded like the reference Linear's output
    tl.store(o_ptr + rows[:, None] * stride_om + rn[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)
    if TAP:
        tl.store(t_ptr + rows[:, None] * stride_tm + rn[None, :], y.to(t_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_partial(acc, acc_u, local, rn, n_ok, row_ok, ws_ptr, WR, N, s, GATED: tl.constexpr):
    """Split s's fp32 sums into the workspace: [SPLITS, WR, C] products (C = 2N gated: gate | up)."""
    C = 2 * N if GATED else N
    mask = row_ok[:, None] & n_ok[None, :]
    part = ws_ptr + s * WR * C + local[:, None] * C + rn[None, :]
    tl.store(part, acc, mask=mask)
    if GATED:
        tl.store(part + N, acc_u, mask=mask)


@triton.jit
def _tile_sum(ws_ptr, WR, local, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr,
              stride_tm, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, TAP: tl.constexpr,
              SCALED: tl.constexpr, SPLITS: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr):
    """The splits' fp32 sums of a [TM, BN] tile added in order 0, 1, .., SPLITS - 1 (elementwise: the same bits
    for any tile), then ``_tile_epilogue``. Loads bypass L1 (".cg"): other programs wrote the workspace."""
    row_ok = rows < M
    mask = row_ok[:, None] & n_ok[None, :]
    C = 2 * N if GATED else N
    acc = tl.zeros([TM, BN], dtype=tl.float32)
    acc_u = acc
    for s in tl.static_range(SPLITS):
        part = ws_ptr + s * WR * C + local[:, None] * C + rn[None, :]
        acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
        if GATED:
            acc_u += tl.load(part + N, mask=mask, other=0.0, cache_modifier=".cg")
    _tile_epilogue(acc, acc_u, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr,
                   stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED)


@triton.jit(do_not_specialize=["M", "row0", "WR"])  # row counts: one compiled kernel whatever M is
def _linear_kernel(
    x_ptr, stride_xm, w_ptr, stride_wn, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr, stride_tm, ws_ptr, WR,
    cnt_ptr, row0, M, N, K, KS,
    GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, TAP: tl.constexpr, SCALED: tl.constexpr,
    SPLITS: tl.constexpr, FIXUP: tl.constexpr, TILES: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (TILES x TM rows from row0, BN features, K split s = [s KS, s KS + KS)); the row blocks of one
    feature block are neighbours (L2). SPLITS == 1: the epilogues here; else the split's sums go to the
    workspace (rows local to row0), then either ``_split_sum_kernel`` adds them (a second launch) or, FIXUP,
    the tile's last split to arrive (a counter per tile) adds them in the same order 0..SPLITS-1 and resets
    the counter: which program adds never changes what is added, or in which order. SCALED: the weight is
    fp8, widened to x's dtype as it is loaded (the MMA is x's), its scale applied in the epilogue."""
    enter(PDL)
    local = tl.program_id(0) * (TILES * TM) + tl.arange(0, TM)
    rows = row0 + local
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.program_id(2)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    acc0 = tl.zeros([TM, BN], dtype=tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    up0, up1, up2, up3 = acc0, acc0, acc0, acc0  # the up halves (GATED)
    for k0 in range(s * KS, tl.minimum(s * KS + KS, K), BK):  # KS: a multiple of BK, so only K cuts a step
        k_off = k0 + rk
        k_ok = k_off < K
        w_mask = n_ok[:, None] & k_ok[None, :]
        wt = tl.trans(tl.load(w_ptr + rn[:, None] * stride_wn + k_off[None, :], mask=w_mask, other=0.0))  # [BK, BN]
        if SCALED:
            wt = wt.to(x_ptr.dtype.element_ty)
        if GATED:
            wut = tl.trans(tl.load(w_ptr + (N + rn)[:, None] * stride_wn + k_off[None, :], mask=w_mask, other=0.0))
            if SCALED:
                wut = wut.to(x_ptr.dtype.element_ty)
        else:
            wut = wt  # unread
        acc0, up0 = _tile_product(x_ptr, stride_xm, rows, k_off, k_ok, M, wt, wut, acc0, up0, wt.dtype, GATED, INTERP)
        if TILES > 1:
            acc1, up1 = _tile_product(x_ptr, stride_xm, rows + TM, k_off, k_ok, M, wt, wut, acc1, up1, wt.dtype, GATED, INTERP)
        if TILES > 2:
            acc2, up2 = _tile_product(x_ptr, stride_xm, rows + 2 * TM, k_off, k_ok, M, wt, wut, acc2, up2, wt.dtype, GATED, INTERP)
            acc3, up3 = _tile_product(x_ptr, stride_xm, rows + 3 * TM, k_off, k_ok, M, wt, wut, acc3, up3, wt.dtype, GATED, INTERP)
    release(PDL)
    if SPLITS == 1:
        _tile_epilogue(acc0, up0, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr,
                       stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED)
        if TILES > 1:
            _tile_epilogue(acc1, up1, rows + TM, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om,
                           t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED)
        if TILES > 2:
            _tile_epilogue(acc2, up2, rows + 2 * TM, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr,
                           stride_om, t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED)
            _tile_epilogue(acc3, up3, rows + 3 * TM, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr,
                           stride_om, t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED)
    else:
        _tile_partial(acc0, up0, local, rn, n_ok, rows < M, ws_ptr, WR, N, s, GATED)
        if TILES > 1:
            _tile_partial(acc1, up1, local + TM, rn, n_ok, rows + TM < M, ws_ptr, WR, N, s, GATED)
        if TILES > 2:
            _tile_partial(acc2, up2, local + 2 * TM, rn, n_ok, rows + 2 * TM < M, ws_ptr, WR, N, s, GATED)
            _tile_partial(acc3, up3, local + 3 * TM, rn, n_ok, rows + 3 * TM < M, ws_ptr, WR, N, s, GATED)
        if FIXUP:
            _fixup(ws_ptr, WR, cnt_ptr, local, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr,
                   stride_om, t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED, SPLITS, TILES, TM, BN)


@triton.jit
def _fixup(ws_ptr, WR, cnt_ptr, local, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om,
           t_ptr, stride_tm, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, TAP: tl.constexpr,
           SCALED: tl.constexpr, SPLITS: tl.constexpr, TILES: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr):
    """The tile's last split to arrive adds every split's sums. The order of CUTLASS's split-K semaphore: the
    program's stores, a barrier, then one release (acq_rel) count; the last arrival's acquire makes the other
    splits' stores visible to its threads (after the barrier that shares the count)."""
    tl.debug_barrier()
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        _tile_sum(ws_ptr, WR, local, rows, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr,
                  stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED, SPLITS, TM, BN)
        if TILES > 1:
            _tile_sum(ws_ptr, WR, local + TM, rows + TM, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr,
                      stride_om, t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED, SPLITS, TM, BN)
        if TILES > 2:
            _tile_sum(ws_ptr, WR, local + 2 * TM, rows + 2 * TM, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm,
                      o_ptr, stride_om, t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED, SPLITS, TM, BN)
            _tile_sum(ws_ptr, WR, local + 3 * TM, rows + 3 * TM, rn, n_ok, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm,
                      o_ptr, stride_om, t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED, SPLITS, TM, BN)
        tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (stream order)


@triton.jit(do_not_specialize=["M", "row0", "WR"])
def _split_sum_kernel(
    ws_ptr, WR, row0, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om, t_ptr, stride_tm,
    GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, TAP: tl.constexpr, SCALED: tl.constexpr,
    SPLITS: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (TM rows from row0, BN features): ``_tile_sum``."""
    enter(PDL)
    release(PDL)
    local = tl.program_id(0) * TM + tl.arange(0, TM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    _tile_sum(ws_ptr, WR, local, row0 + local, rn, rn < N, M, N, x_ptr, w_ptr, b_ptr, s_ptr, r_ptr, stride_rm, o_ptr, stride_om,
              t_ptr, stride_tm, GATED, BIAS, RESIDUAL, TAP, SCALED, SPLITS, TM, BN)


# --------------------------------------------------------------------------- attention


@triton.jit(do_not_specialize=["sq_n", "spos_n", "unit0", "QB", "T"])  # query counts: one kernel for all
def _attention_kernel(
    q_ptr, sq_n, sq_h, sq_t, k_ptr, v_ptr, sk_n, sk_h, sk_l, pos_ptr, spos_n, len_ptr, part_ptr, lse_ptr, rows_ptr,
    o_ptr, so_n, so_h, so_t, cnt_ptr, unit0, QB, T, G, HKV, window, scale,
    D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ROWS: tl.constexpr, COMBINE: tl.constexpr, INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (unit = owner x kv head x query tile, split s): online softmax over the split's slots.
    COMBINE: the unit's last live split to finish (a counter per unit) runs ``_combine_unit``, else
    ``_combine_kernel`` does (a second launch): the same fold in the same order either way."""
    enter(PDL)
    u = tl.program_id(0)
    s = tl.program_id(1)
    nh = (unit0 + u) // QB
    qb = (unit0 + u) % QB
    i = nh // HKV
    kvh = nh % HKV
    t, h, row_ok, pos, lo, hi = query_tile(pos_ptr, spos_n, len_ptr, i, qb, T, G, kvh, window, BLOCK_Q, CAUSAL, WINDOW)
    lo = lo // BLOCK_N * BLOCK_N  # steps at absolute multiples of BLOCK_N
    first = tl.maximum(s * SPLIT, lo)
    last = tl.minimum((s + 1) * SPLIT, hi)
    live = first < last  # else nothing to do: the combine never reads this split
    # ... as a vector for masks (a vector & a scalar bool is a mask Triton's interpreter rejects)
    lives = (tl.zeros([BLOCK_Q], dtype=tl.int32) + first) < last
    d = tl.arange(0, D)
    q = tl.load(q_ptr + i * sq_n + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=(row_ok & lives)[:, None], other=0.0)
    if ROWS:  # owner i's cache row is a device input
        kv_row = tl.load(rows_ptr + i) * sk_n + kvh * sk_h
    else:
        kv_row = i * sk_n + kvh * sk_h
    top = tl.full([BLOCK_Q], MASKED, dtype=tl.float32)
    total = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    for j0 in range(first, last, BLOCK_N):  # absolute multiples of BLOCK_N
        slots = j0 + tl.arange(0, BLOCK_N)
        inside = slots < last
        k = tl.load(k_ptr + kv_row + slots[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + kv_row + slots[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
        scores = ordered_dot(q, tl.trans(k), tl.zeros([BLOCK_Q, BLOCK_N], dtype=tl.float32), INTERP) * scale
        visible = inside[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (slots[None, :] <= pos[:, None])
        if WINDOW:
            visible = visible & (pos[:, None] - slots[None, :] < window)
        scores = tl.where(visible, scores, MASKED)
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        alpha = tl.exp(top - new_top)  # 1 exactly for a row this step shows nothing
        p = tl.where(visible, tl.exp(scores - new_top[:, None]), 0.0)
        total = total * alpha + tl.sum(p, axis=1)
        acc = ordered_dot(p.to(v.dtype), v, acc * alpha[:, None], INTERP)
        top = new_top
    release(PDL)
    _finish_split(acc, top, total, u, s, i, t, h, row_ok, lives, live, lo, hi, part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t,
                  cnt_ptr, D, BLOCK_Q, SPLIT, COMBINE)


@triton.jit
def _finish_split(acc, top, total, u, s, i, t, h, row_ok, lives, live, lo, hi, part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t,
                  cnt_ptr, D: tl.constexpr, BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr, COMBINE: tl.constexpr):
    """A split's partial (acc / total) and log-sum-exp (top + log total) stored for the tile's rows that are real and
    live; COMBINE: the unit's last live split to finish folds the splits (``_combine_unit``). A unit with one
    live split (its visible slots in one SPLIT window: any context of at most SPLIT slots) stores its partial
    as the output: the fold of one split is that partial to the bit (its weight exp(lse - lse) is 1, its
    weight sum 1), and the partials' stores, the counter and the fold's loads (three memory round trips) are
    skipped."""
    d = tl.arange(0, D)
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    splits = tl.cdiv(hi, SPLIT) - lo // SPLIT  # the unit's live splits (when lo < hi)
    if COMBINE and (lo < hi) & (splits == 1):  # one: this split's, if it is live
        if live:
            _store_rows(o_ptr, so_n, so_h, so_t, i, t, h, row_ok, out, D)
    else:
        local = (u * tl.num_programs(1) + s) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        kept = row_ok & lives  # padding rows of the tile (3 of 4 at one query and group 4) store nothing
        tl.store(part_ptr + local[:, None] * D + d[None, :], out, mask=kept[:, None])
        tl.store(lse_ptr + local, tl.where(seen, top + tl.log(total), float("-inf")), mask=kept)
        if COMBINE:
            # The order of CUTLASS's split-K semaphore: every thread's stores, a barrier, one acq_rel count; the
            # last arrival's acquire (shared with its threads by the barrier after the count) shows it the others'.
            tl.debug_barrier()
            if live:
                arrived = tl.atomic_add(cnt_ptr + u, 1, sem="acq_rel", scope="gpu")
                if arrived == splits - 1:
                    _combine_unit(part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t, u * tl.num_programs(1), i, t, h, row_ok, lo,
                                  hi, D, BLOCK_Q, SPLIT)
                    tl.atomic_xchg(cnt_ptr + u, 0)  # ready for the next launch (stream order)
            elif s == 0 and lo >= hi:  # no split is live (no visible slot): the combine's zeros, once
                _combine_unit(part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t, u * tl.num_programs(1), i, t, h, row_ok, lo, hi,
                              D, BLOCK_Q, SPLIT)


@triton.jit(do_not_specialize=["spos_n", "unit0", "QB", "S", "T"])
def _combine_kernel(
    part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t, pos_ptr, spos_n, len_ptr, unit0, QB, S, T, G, HKV, window,
    D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (unit): ``_combine_unit`` over the tile's rows and slot range (as the attention pass saw them)."""
    enter(PDL)
    release(PDL)
    u = tl.program_id(0)
    nh = (unit0 + u) // QB
    qb = (unit0 + u) % QB
    i = nh // HKV
    t, h, row_ok, pos, lo, hi = query_tile(pos_ptr, spos_n, len_ptr, i, qb, T, G, nh % HKV, window, BLOCK_Q, CAUSAL, WINDOW)
    _combine_unit(part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t, u * S, i, t, h, row_ok, lo // BLOCK_N * BLOCK_N, hi, D, BLOCK_Q, SPLIT)


@triton.jit
def _combine_unit(part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t, base, i, t, h, row_ok, lo, hi,
                  D: tl.constexpr, BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr):
    """A unit's live splits (partials at rows (base + s) * BLOCK_Q ..) folded in increasing order, weights
    exp(lse - max lse), stored to its rows. Loads bypass L1 (".cg"): other programs wrote the partials.
    The loads of four splits are issued before any of them is used: a loop that loads one split and adds
    it before loading the next waits one L2 round trip per split (8 at context 2048, twice: the maxima,
    then the fold). The additions stay one split at a time in increasing order (the same bits)."""
    s_lo = lo // SPLIT
    s_hi = tl.where(lo < hi, tl.cdiv(hi, SPLIT), s_lo)  # the splits the attention pass wrote
    q = tl.arange(0, BLOCK_Q)
    best = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    for s in range(s_lo, s_hi, 4):  # four splits a step; padding rows (not row_ok) were not stored: not read either
        l0, l1 = _split_lse(lse_ptr, base, s, s_hi, q, row_ok, BLOCK_Q), _split_lse(lse_ptr, base, s + 1, s_hi, q, row_ok, BLOCK_Q)
        l2, l3 = _split_lse(lse_ptr, base, s + 2, s_hi, q, row_ok, BLOCK_Q), _split_lse(lse_ptr, base, s + 3, s_hi, q, row_ok, BLOCK_Q)
        best = tl.maximum(tl.maximum(tl.maximum(tl.maximum(best, l0), l1), l2), l3)  # exact in any order
    best = tl.where(best == float("-inf"), 0.0, best)  # a row no split showed a slot (padding)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    weight_sum = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for s in range(s_lo, s_hi, 4):  # a split that shows a row nothing adds exact zeros to it
        l0, p0 = _split_lse(lse_ptr, base, s, s_hi, q, row_ok, BLOCK_Q), _split_part(part_ptr, base, s, s_hi, q, d, row_ok, D, BLOCK_Q)
        l1, p1 = _split_lse(lse_ptr, base, s + 1, s_hi, q, row_ok, BLOCK_Q), _split_part(part_ptr, base, s + 1, s_hi, q, d, row_ok, D, BLOCK_Q)
        l2, p2 = _split_lse(lse_ptr, base, s + 2, s_hi, q, row_ok, BLOCK_Q), _split_part(part_ptr, base, s + 2, s_hi, q, d, row_ok, D, BLOCK_Q)
        l3, p3 = _split_lse(lse_ptr, base, s + 3, s_hi, q, row_ok, BLOCK_Q), _split_part(part_ptr, base, s + 3, s_hi, q, d, row_ok, D, BLOCK_Q)
        acc, weight_sum = _fold_split(acc, weight_sum, l0, p0, best, (q * 0 + s) < s_hi)
        acc, weight_sum = _fold_split(acc, weight_sum, l1, p1, best, (q * 0 + s + 1) < s_hi)
        acc, weight_sum = _fold_split(acc, weight_sum, l2, p2, best, (q * 0 + s + 2) < s_hi)
        acc, weight_sum = _fold_split(acc, weight_sum, l3, p3, best, (q * 0 + s + 3) < s_hi)
    _store_rows(o_ptr, so_n, so_h, so_t, i, t, h, row_ok, acc / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None], D)


@triton.jit
def _store_rows(o_ptr, so_n, so_h, so_t, i, t, h, row_ok, out, D: tl.constexpr):
    """The tile's real rows of the attention's output (owner i; token t, head h per row), rounded to its dtype."""
    d = tl.arange(0, D)
    dest = o_ptr + i * so_n + h[:, None] * so_h + t[:, None] * so_t + d[None, :]
    tl.store(dest, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _split_lse(lse_ptr, base, s, s_hi, q, row_ok, BLOCK_Q: tl.constexpr):
    """Split s's log-sum-exps [BLOCK_Q] (-inf for padding rows and past the splits written)."""
    written = (q * 0 + s) < s_hi  # as a vector (a vector & a scalar bool is a mask Triton's interpreter rejects)
    return tl.load(lse_ptr + (base + s) * BLOCK_Q + q, mask=row_ok & written, other=float("-inf"), cache_modifier=".cg")


@triton.jit
def _split_part(part_ptr, base, s, s_hi, q, d, row_ok, D: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Split s's partial outputs [BLOCK_Q, D] (zeros for padding rows and past the splits written)."""
    local = (base + s) * BLOCK_Q + q
    written = (q * 0 + s) < s_hi
    return tl.load(part_ptr + local[:, None] * D + d[None, :], mask=(row_ok & written)[:, None], other=0.0, cache_modifier=".cg")


@triton.jit
def _fold_split(acc, weight_sum, lse, part, best, live):
    """One split added to the fold (the arithmetic of every split, in the caller's order); ``live`` [BLOCK_Q]
    False past the last split: nothing added."""
    weight = tl.exp(lse - best)
    return tl.where(live[:, None], acc + weight[:, None] * part, acc), tl.where(live, weight_sum + weight, weight_sum)


# --------------------------------------------------------------------------- ops


def max_shared_mem(index: int) -> int:
    """Shared memory one program may hold on CUDA device ``index`` (the opt-in limit Triton checks a
    compiled kernel against before its first launch)."""
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


class ExactOps(TritonOps):
    """Batch-invariant kernels on CUDA tensors (or CPU tensors under Triton's interpreter).

    ``split_slots``: key slots per attention split (a multiple of the inner step; the result depends on it,
    so one backend keeps one value); ``linear_plans`` maps (N, K, gated) to an ``ExactLinearPlan``
    replacing ``plan.exact_linear_plan``'s (benchmark sweeps); ``partial_bytes``: the fp32 split partials
    one attention launch may hold (more units run as more launches, same arithmetic); ``workspace_bytes``:
    the fp32 split-K partials one linear launch may hold (more rows run as more launches, same arithmetic);
    ``block_q``: query rows (token x grouped head) of one attention tile, a power of two >= 16 (the rows of a
    tile share its loads of the keys; the result depends on it, so one backend keeps one value);
    ``combine_in_kernel``: each attention unit's last split folds the splits (no second launch; the same fold,
    so the same bits: H200, Qwen3-8B shape, 16.7 against 19.5 µs per layer at one query, 36.5 against 40.0 at
    4 × 16); ``False`` folds them in a second launch; ``block_n``: key slots per inner step of a split, a power
    of two >= 16 dividing ``split_slots`` (default ``plan.exact_attention_block_n``; the result depends on it, so
    one backend keeps one value); ``attention_warps``: warps per attention program, a power of two <= 8 (they
    share a tile's score rows, so their reductions' order and the result depend on it: one backend keeps one
    value); ``attention_stages``: key / value loads in flight per attention program (the software pipeline's
    depth: when each load is issued, never what is summed; the same bits at every depth; default
    ``plan.exact_attention_stages`` within ``shared_bytes``); ``pdl``: ``TritonOps``' (launch overlap only: the
    same arithmetic); ``wide_tiles``: a launch of four 16-row tiles per program computes them as one 64-row tile
    (one ``tl.dot``, which Triton compiles to Hopper's warp-group MMA, ``wgmma``, instead of four 16-row
    ``mma.sync``: the same K steps of 16 products in the same order, fp32 accumulate). That the two instructions
    round a step alike is the hardware's property, not Triton's contract: measured bit-identical on an H100 for
    every Qwen3-8B weight at 64 and 128 rows and against rows alone (benchmarks/exact_wide_tiles.py), and the
    gpu-marked batch-invariance tests run it (bf16 and fp32). Default (``None``): on an sm90 GPU (the four-owner
    verify 0.27 ms shorter there: its o product 22.0 -> 16.5 µs), but not for fp8 weights (their widened tiles
    pass through shared memory to the warp-group MMA: a four-owner fp8 draft 1.68 -> 1.82 ms), nor on other GPUs
    (not measured); ``True`` / ``False``: always / never.
    """

    kind = "exact"  # what TorchBackend(kernels=ExactOps(...)) reports as its kernels
    fp8_linear = True  # ``linear(..., scale=)``: fp8 weights (``kernels.quant``)

    def __init__(self, split_slots: int = EXACT_SPLIT_SLOTS, linear_plans: dict | None = None, partial_bytes: int = EXACT_PARTIAL_BYTES,
                 workspace_bytes: int = EXACT_WORKSPACE_BYTES, combine_in_kernel: bool = True, block_q: int = EXACT_BLOCK_Q,
                 block_n: int | None = None, attention_warps: int = 4, attention_stages: int | None = None, pdl: bool | None = None,
                 wide_tiles: bool | None = None) -> None:
        super().__init__(pdl=pdl)
        if attention_warps not in (1, 2, 4, 8):
            raise ValueError(f"attention_warps must be 1, 2, 4 or 8, got {attention_warps}")
        if attention_stages is not None and attention_stages not in range(1, 7):
            raise ValueError(f"attention_stages must be in [1, 6], got {attention_stages}")
        if block_q < 16 or block_q & (block_q - 1):
            raise ValueError(f"block_q must be a power of two >= 16, got {block_q}")
        if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        if block_n is not None and (split_slots < block_n or split_slots % block_n):
            raise ValueError(f"split_slots must be a positive multiple of block_n ({block_n}), got {split_slots}")
        self.block_q, self.block_n, self.attention_warps, self.attention_stages = block_q, block_n, attention_warps, attention_stages
        self.split_slots, self.partial_bytes, self.workspace_bytes = split_slots, partial_bytes, workspace_bytes
        self.combine_in_kernel, self.wide_tiles = combine_in_kernel, wide_tiles
        self.exact_plans = dict(linear_plans or {})
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def linear(self, x, weight, bias=None, norm=None, eps=0.0, gated=False, residual=None, out=None, out_dtype=None, tap=None,
               scale=None):
        """``TritonOps.linear``'s contract (y [M, N] = epilogue(prologue(x) @ weight.T)), one kernel for every M
        (two with split-K: the splits' sums, then their ordered sum and the epilogues); with ``norm``, the
        row-local RMSNorm pass first. ``scale`` [N or 2N] fp32: ``weight`` is fp8 (``kernels.quant``), the
        product is multiplied by it per feature and rounded to x's dtype (``TorchOps.linear``'s twin)."""
        M, K = x.shape
        if scale is not None and (weight.dtype != FP8 or scale.dtype != torch.float32 or scale.shape != (weight.shape[0],)):
            raise ValueError(f"an fp8 linear takes a float8_e4m3fn weight and a float32 scale per row ({weight.shape[0]}), "
                             f"got {weight.dtype} and {scale.dtype} {tuple(scale.shape)}")
        N = weight.shape[0] // 2 if gated else weight.shape[0]
        if x.stride(1) != 1 or x.stride(0) != K or x.data_ptr() % 16:
            # One layout of the x tile for every call of a weight: Triton vectorizes its load (and so orders
            # the norm's sum of squares) by the pointer's and the row stride's alignment.
            x = x.clone(memory_format=torch.contiguous_format)
        if norm is not None:
            x = self.rms_norm(x, norm, eps)  # one program per row: the row's bits whatever M is
        if out is None:
            out = torch.empty((M, N), dtype=out_dtype or (x.dtype if scale is not None else weight.dtype), device=x.device)
        plan = self.linear_plan(N, K, gated, weight.element_size(), x.device)
        splits, width = exact_split_k(K, plan)
        tiles, block_n, stages = exact_linear_launch(plan, M, gated, weight.element_size(), N, self.processors(x.device),
                                                     self.shared_bytes(x.device), x.element_size())
        tm = EXACT_TILE_M
        if tiles == 4 and self.wide(x.device, scale is not None):
            tm, tiles = 4 * EXACT_TILE_M, 1  # the same rows, sums and order: one 64-row tile (wgmma on sm90)
        blocks = triton.cdiv(N, block_n)
        columns = 2 * N if gated else N
        step = M if splits == 1 else exact_workspace_rows(M, splits, columns, self.workspace_bytes)  # rows per launch
        workspace, counters = weight, weight  # unread with one split
        if splits > 1:
            workspace = self.buffer("partials", x.device, splits * step * columns, torch.float32)
            counters = self.buffer("counters", x.device, triton.cdiv(step, tiles * tm) * blocks, torch.int32)
        residual_t = residual if residual is not None else out
        tap_t = tap if tap is not None else out
        tensors = (x, weight, bias if bias is not None else weight, scale if scale is not None else weight, residual_t, residual_t.stride(0),
                   out, out.stride(0), tap_t, tap_t.stride(0))
        flags = dict(GATED=gated, BIAS=bias is not None, RESIDUAL=residual is not None, TAP=tap is not None, SCALED=scale is not None,
                     SPLITS=splits)
        fixup = splits > 1 and plan.fixup
        for row0 in range(0, M, step):
            rows = min(step, M - row0)
            _linear_kernel[(triton.cdiv(rows, tiles * tm), blocks, splits)](
                x, x.stride(0), weight, weight.stride(0), *tensors[2:], workspace, step, counters, row0, row0 + rows, N, K, width,
                **flags, FIXUP=fixup, TILES=tiles, TM=tm, BN=block_n, BK=plan.block_k, INTERP=INTERPRETED,
                num_warps=plan.warps, num_stages=stages, **self.launch(x.device),
            )
            if splits > 1 and not fixup:
                _split_sum_kernel[(triton.cdiv(rows, EXACT_TILE_M), triton.cdiv(N, EXACT_SUM_BLOCK_N))](
                    workspace, step, row0, row0 + rows, N, *tensors, **flags, TM=EXACT_TILE_M, BN=EXACT_SUM_BLOCK_N, num_warps=4,
                    **self.launch(x.device),
                )
        return out

    def wide(self, device: torch.device, scaled: bool) -> bool:
        """Whether a launch of four 16-row tiles runs them as one 64-row tile (``wide_tiles``)."""
        if self.wide_tiles is not None:
            return self.wide_tiles
        if scaled or device.type != "cuda":
            return False
        return self.device_fact("sm90", device, lambda index: torch.cuda.get_device_capability(index)[0] == 9)

    def linear_plan(self, N: int, K: int, gated: bool, element_bytes: int, device: torch.device) -> ExactLinearPlan:
        """The weight's tiling: ``linear_plans`` (sweeps), else ``plan.exact_linear_plan`` for this device."""
        plan = self.exact_plans.get((N, K, gated))
        return plan if plan is not None else exact_linear_plan(N, K, gated, element_bytes, self.processors(device))

    def buffer(self, name: str, device: torch.device, elements: int, dtype: torch.dtype) -> torch.Tensor:
        """The split-K ``partials`` (fp32 sums) or the ``counters`` of the in-kernel sums (int32, zero between
        launches: each launch's last arrivals reset theirs): one buffer per (name, device, stream), allocated
        when first needed, only ever replaced by a larger one, and a replaced one stays alive (CUDA graphs
        captured with it keep its address). The calls of one stream run in order, so they can share it.
        Counters start at ``EXACT_COUNTERS`` entries: a buffer first made inside a CUDA-graph capture would
        hold its zeros only from the graph's first replay on, so the eager warm-up before a capture makes it."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        held = self._buffers.setdefault((name, str(device), stream), [])
        if not held or held[-1].numel() < elements:
            least = EXACT_COUNTERS if dtype == torch.int32 else 0
            held.append(torch.zeros(max(elements, least), dtype=dtype, device=device))
        return held[-1]

    def shared_bytes(self, device: torch.device) -> int:
        """Shared memory the pipelined steps of one exact program may hold on ``device``: Triton's per-program
        limit less ``EXACT_SHARED_HEADROOM`` for its other buffers (211 KiB on an H100 / H200, ~83 KiB on an
        sm86 / sm89 GPU); ``EXACT_SHARED_BYTES`` under Triton's interpreter, which allocates nothing."""
        if device.type != "cuda":
            return EXACT_SHARED_BYTES
        return self.device_fact("shared_bytes", device, lambda index: max_shared_mem(index) - EXACT_SHARED_HEADROOM)

    def attention(self, q, k_cache, v_cache, rows, q_positions, kv_len, causal, window):
        """``TritonOps.attention``'s contract (q [n, Hq, T, D] -> [n, Hq, T, D]) with fixed-size key splits."""
        n, heads, T, D = q.shape
        kv_heads, L = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        block_n = self.block_n or exact_attention_block_n(D)
        if self.split_slots % block_n:
            raise ValueError(f"split_slots must be a multiple of {block_n} (head_dim {D}), got {self.split_slots}")
        splits = exact_split_count(L, self.split_slots)
        tiles = triton.cdiv(T * group, self.block_q)  # query tiles per (owner, kv head)
        units = n * kv_heads * tiles
        per_launch = exact_units_per_launch(units, splits, D, self.partial_bytes, self.block_q)
        out = torch.empty((n, T, heads, D), dtype=q.dtype, device=q.device)
        part = torch.empty((per_launch * splits * self.block_q, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((per_launch * splits * self.block_q,), dtype=torch.float32, device=q.device)
        shape = dict(D=D, BLOCK_Q=self.block_q, BLOCK_N=block_n, SPLIT=self.split_slots, CAUSAL=causal, WINDOW=window > 0)
        counters = self.buffer("counters", q.device, per_launch, torch.int32) if self.combine_in_kernel else kv_len
        stages = self.attention_stages or exact_attention_stages(D, k_cache.element_size(), block_n, self.shared_bytes(q.device))
        for unit0 in range(0, units, per_launch):
            count = min(per_launch, units - unit0)
            depth, registers = stages, None  # a crowded launch: more programs per SM (the same bits)
            if self.attention_stages is None:
                depth, registers = exact_attention_launch(count * splits, self.processors(q.device), stages)
            _attention_kernel[(count, splits)](
                q, q.stride(0), q.stride(1), q.stride(2), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
                k_cache.stride(2), q_positions, q_positions.stride(0), kv_len, part, lse,
                rows if rows is not None else kv_len, out, out.stride(0), out.stride(2), out.stride(1), counters, unit0, tiles, T,
                group, kv_heads, window, D**-0.5, ROWS=rows is not None, COMBINE=self.combine_in_kernel, INTERP=INTERPRETED,
                num_warps=self.attention_warps, num_stages=depth, **shape, **self.launch(q.device), **({"maxnreg": registers} if registers else {}),
            )
            if not self.combine_in_kernel:
                _combine_kernel[(count,)](
                    part, lse, out, out.stride(0), out.stride(2), out.stride(1), q_positions, q_positions.stride(0), kv_len,
                    unit0, tiles, splits, T, group, kv_heads, window, num_warps=4, **shape, **self.launch(q.device),
                )
        return out.transpose(1, 2)
