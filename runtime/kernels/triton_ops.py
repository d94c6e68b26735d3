"""Triton kernels of the fast CUDA path (same signatures as the twin in ``torch_ops``).

Per decoder layer, one token (the decode step, M = 1), six or seven launches:

==================  =======================================================================
``linear``          RMSNorm(x) @ [Wq|Wk|Wv]^T          (norm as prologue + per-row scale)
``qk_rope_write``   q/k-norm, RoPE, K/V written at their cache slots, Q to a buffer
``attention``       over the VALID slots only (+ ``combine`` when the slots are split)
``linear``          x += attended @ Wo^T               (residual epilogue, in place)
``linear``          silu(h @ Wg^T) * (h @ Wu^T), h = RMSNorm(x)   (one [Wg|Wu] weight)
``linear``          x += a @ Wd^T                      (+ the tap columns, for tap layers)
==================  =======================================================================

More rows (verify, draft, prefill: M >= 2) run the same ``linear`` calls as
cuBLAS GEMMs on the fused weights with the norm, the SiLU·mul and the residual
around them (a one-pass RMSNorm kernel, a SiLU·mul kernel, ``addmm_`` adding the
residual in place): cuBLAS streams weights faster than these tiles from M = 16
on (measured on an H200).

Every launch reads device lengths (``start``, ``kv_len``) from device memory,
never syncs, and allocates only through torch: everything here can be
captured in a CUDA graph, and one capture serves every context length.
fp32 dots run in IEEE fp32 (no TF32), so fp32 models give the CPU's tokens.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_trt.export.layers import EagerKernels
from dflash_trt.runtime.kernels.plan import attention_plan, linear_plan

try:  # programmatic dependent launch (sm90+): Triton's grid dependency control
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without it: every launch stays plain
    gdc_launch_dependents = gdc_wait = None

MASKED = tl.constexpr(-1.0e30)  # score of an invisible slot (finite: a row with no visible slot yet stays NaN-free)


def pdl_capable(device: torch.device) -> bool:
    """Whether launches on ``device`` can overlap their predecessor's end: sm90+, a Triton with ``launch_pdl``,
    not the CPU interpreter."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_default(device: torch.device) -> bool:
    """Whether ops left to choose (``pdl=None``) overlap launches: wherever capable, unless turned off
    (``DFLASH_TRT_PDL=0``). It shortens every graph on the device and changes no bit: on an H200 the
    Qwen3-8B-shape decode step 4.705 against 4.816 ms (exact kernels); on an H100 the default pair's engine
    alone (gpu_e2e, alternated) +10% DFlash and +18% plain decoding at one session, +10% DFlash at 16. Through
    the server, where the host sets the pace, the windows' own spread (±25% on one machine) hides any effect:
    benchmarks/RESULTS.md, "Programmatic dependent launch on by default"."""
    return os.environ.get("DFLASH_TRT_PDL") != "0" and pdl_capable(device)


@triton.jit
def enter(PDL: tl.constexpr):
    """Every kernel's first statement. PDL (the launch has ``launch_pdl``): wait until the launch before this one
    has finished and its writes are visible, before any load or store of this program. What each program
    computes, and in which order, does not change; stream order stays transitive (a launch waits for its
    predecessor, which waited for its own)."""
    if PDL:
        gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """PDL: let the next launch start (its programs wait in its ``enter``), placed after a kernel's main loop, so
    the next launch's start-up overlaps this one's last work instead of following its end. At entry instead, the
    next launch's programs were placed while this one's still ran, crowding the processors that happened to be
    free first: the exact down projection took 35 instead of 28 µs (H200, benchmarks/RESULTS.md)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, stride_wn, b_ptr, g_ptr, r_ptr, o_ptr, t_ptr, N, K, eps,
    NORM: tl.constexpr, GATED: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, TAP: tl.constexpr,
    EVEN_K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EARLY_SUM: tl.constexpr, PDL: tl.constexpr = False,
):
    """y[n] for BN features of one row; GATED: rows n of W are gates, rows N + n ups."""
    enter(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    u_ptrs = w_ptrs + N * stride_wn
    squares = tl.zeros([BK], dtype=tl.float32)
    if EARLY_SUM:
        acc = tl.zeros([BN], dtype=tl.float32)
        acc_u = tl.zeros([BN], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BN, BK], dtype=tl.float32)
        acc2_u = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            k_ok = rk < BK
        else:
            k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:
            wu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            squares += x * x
            # the reference rounds the normed input to the weight dtype before its GEMM
            x = (x * tl.load(g_ptr + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)).to(w.dtype).to(tl.float32)
        if EARLY_SUM:
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
            if GATED:
                acc_u += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        else:
            acc2 += w.to(tl.float32) * x[None, :]
            if GATED:
                acc2_u += wu.to(tl.float32) * x[None, :]
        w_ptrs += BK
        u_ptrs += BK
    release(PDL)
    if not EARLY_SUM:
        acc = tl.sum(acc2, axis=1)
        if GATED:
            acc_u = tl.sum(acc2_u, axis=1)
    if NORM:
        scale = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
        acc = acc * scale
        if GATED:
            acc_u = acc_u * scale
    if BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_u += tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_u
    if RESIDUAL:
        acc += tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    y = acc.to(w_ptr.dtype.element_ty)  # rounded like the reference Linear's output
    tl.store(o_ptr + rn, y.to(o_ptr.dtype.element_ty), mask=n_ok)
    if TAP:
        tl.store(t_ptr + rn, y.to(t_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _embed_kernel(tokens_ptr, stride_tn, table_ptr, stride_v, start_ptr, x_ptr, pos_ptr, len_ptr, T, H, mask_id,
                  TOKENS: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False):
    """Row r = (i, t): x[r] = table[token], positions[r] = start[i] + t; t = 0 also lengths[i] = start[i] + T.
    token: tokens[i, t] (TOKENS; rows stride_tn apart, unit inner stride), else the draft block's: the anchor
    tokens_ptr[i * stride_tn] at t = 0, mask_id after."""
    enter(PDL)
    r = tl.program_id(0)
    i = r // T
    t = r % T
    if TOKENS:
        token = tl.load(tokens_ptr + i * stride_tn + t)
    else:
        token = tl.load(tokens_ptr + i * stride_tn)
        if t > 0:
            token = token * 0 + mask_id
    start = tl.load(start_ptr + i)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        tl.store(x_ptr + r.to(tl.int64) * H + h, tl.load(table_ptr + token * stride_v + h, mask=h < H), mask=h < H)
    release(PDL)
    tl.store(pos_ptr + r, start + t)
    if t == 0:
        tl.store(len_ptr + i, start + T)


@triton.jit
def _rms_norm_kernel(x_ptr, stride_xm, g_ptr, y_ptr, stride_ym, K, eps, BK: tl.constexpr, PDL: tl.constexpr = False):
    """One row: y = x * rsqrt(mean(x^2) + eps) * g (fp32 math, one rounding)."""
    enter(PDL)
    m = tl.program_id(0)
    rk = tl.arange(0, BK)
    ok = rk < K
    x = tl.load(x_ptr + m * stride_xm + rk, mask=ok, other=0.0).to(tl.float32)
    release(PDL)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    y = x * scale * tl.load(g_ptr + rk, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rk, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(h_ptr, stride_hm, y_ptr, stride_ym, N, BN: tl.constexpr, PDL: tl.constexpr = False):
    """y[m, n] = silu(h[m, n]) * h[m, N + n] (h = [gate | up] of a row)."""
    enter(PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = rn < N
    gate = tl.load(h_ptr + m * stride_hm + rn, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + m * stride_hm + N + rn, mask=ok, other=0.0).to(tl.float32)
    release(PDL)
    tl.store(y_ptr + m * stride_ym + rn, (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_rope(x1, x2, w_ptr, half, cos, sin, eps, D: tl.constexpr, NORM: tl.constexpr):
    """RMSNorm over the head (two halves, fp32) then rotate-half RoPE."""
    if NORM:
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1 = x1 * scale * tl.load(w_ptr + half).to(tl.float32)
        x2 = x2 * scale * tl.load(w_ptr + D // 2 + half).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _qk_rope_write_kernel(
    qkv_ptr, stride_m, start_ptr, freq_ptr, qn_ptr, kn_ptr, q_ptr, k_ptr, v_ptr, rows_ptr, len_ptr,
    stride_cn, stride_ch, stride_cl, T, HQ, HKV, eps,
    D: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr, LENGTHS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (row m, head h): h < HQ -> Q head h; else K/V head h - HQ into its cache slot.

    ROWS: owner i's cache row is ``rows[i]`` (a device input); else row i of the caches.
    LENGTHS: owner i writes only its first ``lengths[i]`` rows (the rest pad a ragged batch)."""
    enter(PDL)
    release(PDL)
    m = tl.program_id(0)
    h = tl.program_id(1)
    i = m // T
    if ROWS:
        cache_row = tl.load(rows_ptr + i)
    else:
        cache_row = i
    position = tl.load(start_ptr + i) + m % T
    half = tl.arange(0, D // 2)
    angles = position.to(tl.float32) * tl.load(freq_ptr + half)
    cos, sin = tl.cos(angles), tl.sin(angles)
    row = qkv_ptr + m * stride_m
    if h < HQ:
        x1 = tl.load(row + h * D + half).to(tl.float32)
        x2 = tl.load(row + h * D + D // 2 + half).to(tl.float32)
        y1, y2 = _rms_rope(x1, x2, qn_ptr, half, cos, sin, eps, D, NORM)
        out = q_ptr + (m * HQ + h) * D
        tl.store(out + half, y1.to(q_ptr.dtype.element_ty))
        tl.store(out + D // 2 + half, y2.to(q_ptr.dtype.element_ty))
    else:
        j = h - HQ
        key = row + (HQ + j) * D
        x1 = tl.load(key + half).to(tl.float32)
        x2 = tl.load(key + D // 2 + half).to(tl.float32)
        y1, y2 = _rms_rope(x1, x2, kn_ptr, half, cos, sin, eps, D, NORM)
        if LENGTHS:
            limit = tl.load(len_ptr + i)
        else:
            limit = T
        # Whether this row is written, as vectors (a vector & a scalar bool is a mask Triton's interpreter rejects).
        write_half = (tl.zeros_like(half) + m % T) < limit
        slot = cache_row * stride_cn + j * stride_ch + position * stride_cl
        tl.store(k_ptr + slot + half, y1.to(k_ptr.dtype.element_ty), mask=write_half)
        tl.store(k_ptr + slot + D // 2 + half, y2.to(k_ptr.dtype.element_ty), mask=write_half)
        full = tl.arange(0, D)
        value = tl.load(row + (HQ + HKV + j) * D + full)
        tl.store(v_ptr + slot + full, value.to(v_ptr.dtype.element_ty), mask=(tl.zeros_like(full) + m % T) < limit)


@triton.jit
def query_tile(pos_ptr, spos_n, len_ptr, i, qb, T, G, kvh, window, BLOCK_Q: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Rows r = t * G + g of query tile qb (owner i, kv head kvh): token t, head h, whether the row is real,
    its position, and the tile's slot range [lo, hi): the union of its rows' visible slots (causal: up to
    the last row's position; window: from the first row's position - window + 1). Both attention kernels
    (this module's, ``exact_ops``') start here."""
    r = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    t = r // G
    h = kvh * G + r % G
    row_ok = t < T
    pos = tl.load(pos_ptr + i * spos_n + t, mask=row_ok, other=0)
    hi = tl.load(len_ptr + i)
    if CAUSAL:
        hi = tl.minimum(hi, tl.max(tl.where(row_ok, pos, 0), axis=0) + 1)
    lo = hi * 0
    if WINDOW:
        lo = tl.maximum(tl.min(tl.where(row_ok, pos, hi), axis=0) - window + 1, 0)
    return t, h, row_ok, pos, lo, hi


@triton.jit
def _attention_kernel(
    q_ptr, sq_n, sq_h, sq_t, k_ptr, v_ptr, sk_n, sk_h, sk_l, pos_ptr, spos_n, len_ptr,
    o_ptr, so_n, so_h, so_t, part_ptr, lse_ptr, rows_ptr, T, G, HKV, window, scale,
    D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (split s, owner x kv head, query block): online softmax over its slice of valid slots."""
    enter(PDL)
    s = tl.program_id(0)
    nh = tl.program_id(1)
    qb = tl.program_id(2)
    splits = tl.num_programs(0)
    i = nh // HKV
    kvh = nh % HKV
    t, h, row_ok, pos, lo, hi = query_tile(pos_ptr, spos_n, len_ptr, i, qb, T, G, kvh, window, BLOCK_Q, CAUSAL, WINDOW)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + i * sq_n + h[:, None] * sq_h + t[:, None] * sq_t + d[None, :], mask=row_ok[:, None], other=0.0)
    width = tl.maximum(hi - lo, 0)
    chunk = tl.cdiv(tl.cdiv(width, splits), BLOCK_N) * BLOCK_N
    first = lo + s * chunk
    last = tl.minimum(first + chunk, hi)
    top = tl.full([BLOCK_Q], MASKED, dtype=tl.float32)
    total = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
    if ROWS:  # owner i's cache row is a device input
        kv_row = tl.load(rows_ptr + i) * sk_n + kvh * sk_h
    else:
        kv_row = i * sk_n + kvh * sk_h
    for j0 in range(first, last, BLOCK_N):
        slots = j0 + tl.arange(0, BLOCK_N)
        inside = slots < last
        k = tl.load(k_ptr + kv_row + slots[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + kv_row + slots[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)  # in flight with K
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = inside[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (slots[None, :] <= pos[:, None])
        if WINDOW:
            visible = visible & (pos[:, None] - slots[None, :] < window)
        scores = tl.where(visible, scores, MASKED)
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        alpha = tl.exp(top - new_top)
        p = tl.where(visible, tl.exp(scores - new_top[:, None]), 0.0)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        top = new_top
    release(PDL)
    seen = total > 0
    out = acc / tl.where(seen, total, 1.0)[:, None]
    if SPLIT:
        slot = (s * tl.num_programs(1) + nh) * tl.num_programs(2) + qb
        rows = slot * BLOCK_Q + tl.arange(0, BLOCK_Q)
        tl.store(part_ptr + rows[:, None] * D + d[None, :], out)
        tl.store(lse_ptr + rows, tl.where(seen, top + tl.log(total), float("-inf")))
    else:
        dest = o_ptr + i * so_n + h[:, None] * so_h + t[:, None] * so_t + d[None, :]
        tl.store(dest, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_kernel(
    part_ptr, lse_ptr, o_ptr, so_n, so_h, so_t, T, G, HKV,
    D: tl.constexpr, BLOCK_Q: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (owner x kv head, query block, ROWS-row slice): the splits' outputs weighted by exp(lse - max lse).

    SPLITS is static: the loops unroll, so every split's loads are issued at once (latency, not bytes,
    is what a short combine pays); row slices spread the partials' bytes over more processors.
    """
    enter(PDL)
    release(PDL)
    nh = tl.program_id(0)
    qb = tl.program_id(1)
    programs = tl.num_programs(0) * tl.num_programs(1)
    local = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    base = nh * tl.num_programs(1) + qb
    split = tl.arange(0, SPLITS_P2)
    lse = tl.load(  # [S, BQ]
        lse_ptr + (split[:, None] * programs + base) * BLOCK_Q + local[None, :], mask=(split < SPLITS)[:, None], other=float("-inf")
    )
    best = tl.max(lse, axis=0)
    best = tl.where(best == float("-inf"), 0.0, best)  # padding rows: no split saw a slot
    weight_sum = tl.sum(tl.exp(lse - best[None, :]), axis=0)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        rows = (s * programs + base) * BLOCK_Q + local
        weight = tl.exp(tl.load(lse_ptr + rows) - best)
        acc += weight[:, None] * tl.load(part_ptr + rows[:, None] * D + d[None, :])
    r = qb * BLOCK_Q + local
    t = r // G
    h = (nh % HKV) * G + r % G
    i = nh // HKV
    out = acc / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None]
    dest = o_ptr + i * so_n + h[:, None] * so_h + t[:, None] * so_t + d[None, :]
    tl.store(dest, out.to(o_ptr.dtype.element_ty), mask=(t < T)[:, None])


class TritonOps(EagerKernels):
    """The fast kernels on CUDA tensors. Also a ``Kernels`` object (``attention`` over valid slots).

    ``splits`` forces the attention split count; ``linear_plans`` maps (N, K, gated) to the
    ``LinearPlan`` of a one-row GEMV, replacing ``plan.linear_plan``'s choice (benchmark sweeps); ``pdl``:
    launch with programmatic dependent launch (each kernel's start overlaps the previous launch's end;
    ``enter``), None: ``pdl_default``.
    """

    def __init__(self, splits: int | None = None, linear_plans: dict | None = None, pdl: bool | None = None) -> None:
        self.splits = splits
        self.linear_plans = dict(linear_plans or {})
        self.pdl = pdl
        self._device_facts: dict[tuple[str, int], object] = {}  # (fact, CUDA device index) -> value (``device_fact``)
        self._launch: dict[str, dict] = {}

    def launch(self, device: torch.device) -> dict:
        """Launch arguments every kernel of these ops takes: ``PDL`` (its ``enter``) and, when on, ``launch_pdl``."""
        key = str(device)
        if key not in self._launch:
            on = pdl_default(device) if self.pdl is None else bool(self.pdl)
            if on and not pdl_capable(device):
                raise ValueError(f"pdl: programmatic dependent launch needs an sm90+ CUDA device and a Triton with launch_pdl, got {device}")
            self._launch[key] = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
        return self._launch[key]

    def device_fact(self, fact: str, device: torch.device, read):
        """``read(index)`` of CUDA ``device`` (its index), read once per ops and device: launches ask per layer."""
        key = (fact, device.index if device.index is not None else torch.cuda.current_device())
        if key not in self._device_facts:
            self._device_facts[key] = read(key[1])
        return self._device_facts[key]

    def processors(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 4  # Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors
        return self.device_fact("processors", device, lambda index: torch.cuda.get_device_properties(index).multi_processor_count)

    def linear(self, x, weight, bias=None, norm=None, eps=0.0, gated=False, residual=None, out=None, out_dtype=None, tap=None,
               scale=None):
        """y [M, N] = epilogue(prologue(x) @ weight.T), x [M, K] with unit inner stride.

        ``norm`` [K]: RMSNorm weight (x is normalized first); ``gated``: weight is [gate; up] (2N rows)
        and y = silu(x @ gate.T) * (x @ up.T); ``bias`` [N or 2N]; ``residual`` [M, N]: added (``out``
        may be the residual itself: in place); ``tap`` [M, N]: a second destination of y. y is rounded
        to the weight dtype, then stored as ``out_dtype``. Never syncs. ``scale``: an fp8 weight's scale
        per row (``kernels.quant``), which these kernels do not take (``fp8_linear``: the exact ones do).
        """
        if scale is not None:
            raise ValueError("the fast Triton kernels have no fp8 products (fp8_linear is False): use ExactOps")
        M, K = x.shape
        N = weight.shape[0] // 2 if gated else weight.shape[0]
        if M > 1:
            return self._cublas_linear(x, weight, bias, norm, eps, gated, residual, out, out_dtype, tap)
        if out is None:
            out = torch.empty((1, N), dtype=out_dtype or weight.dtype, device=x.device)
        plan = self.linear_plans.get((N, K, gated)) or linear_plan(N, K, gated, weight.element_size())
        _gemv_kernel[(triton.cdiv(N, plan.block_n),)](
            x, weight, weight.stride(0), bias if bias is not None else weight, norm if norm is not None else weight,
            residual if residual is not None else out, out, tap if tap is not None else out, N, K, eps,
            NORM=norm is not None, GATED=gated, BIAS=bias is not None, RESIDUAL=residual is not None,
            TAP=tap is not None, EVEN_K=K % plan.block_k == 0, BN=plan.block_n, BK=plan.block_k,
            EARLY_SUM=plan.early_sum, num_warps=plan.warps, **self.launch(x.device),
        )
        return out

    def _cublas_linear(self, x, weight, bias, norm, eps, gated, residual, out, out_dtype, tap):
        """M > 1: cuBLAS on the fused weight; RMSNorm, SiLU·mul and the residual around it."""
        if norm is not None:
            x = self.rms_norm(x, norm, eps)
        if residual is not None and out is not None and out.data_ptr() == residual.data_ptr() and bias is None and not gated:
            out.addmm_(x, weight.t())  # the residual added by cuBLAS's epilogue, in place
            if tap is not None:
                tap.copy_(out)
            return out
        y = F.linear(x, weight, bias)
        if gated:
            y = self.silu_mul(y)
        if residual is not None:
            y = y + residual
        if out_dtype is not None and out_dtype != y.dtype:
            y = y.to(out_dtype)
        if tap is not None:
            tap.copy_(y)
        return y if out is None else out.copy_(y)

    def embed(self, table, start, tokens=None, anchor=None, mask_id=0, block=0, scale=1.0):
        """``TorchOps.embed`` in one launch (the rows copied bit for bit); a scale other than 1 is torch's ``x * scale``
        after it (its rounding: Triton's interpreter rounds bf16 otherwise than the GPU)."""
        if tokens is not None and tokens.stride(1) != 1:
            tokens = tokens.contiguous()
        ids = tokens if tokens is not None else anchor
        n, T = (tokens.shape if tokens is not None else (anchor.shape[0], block))
        H = table.shape[1]
        x = torch.empty((n * T, H), dtype=table.dtype, device=table.device)
        positions = torch.empty((n, T), dtype=torch.promote_types(start.dtype, torch.int64), device=start.device)  # start + arange
        lengths = torch.empty_like(start)
        _embed_kernel[(n * T,)](
            ids, ids.stride(0), table, table.stride(0), start, x, positions, lengths, T, H, mask_id,
            TOKENS=tokens is not None, BH=min(triton.next_power_of_2(H), 1024), num_warps=4, **self.launch(table.device),
        )
        return (x if scale == 1.0 else x * scale), positions, lengths

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x [M, K] (unit inner stride), one pass."""
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, x.stride(0), weight, y, y.stride(0), x.shape[1], eps, BK=block, num_warps=4 if block <= 4096 else 8, **self.launch(x.device)
        )
        return y

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, 2N] = [gate | up] -> silu(gate) * up [M, N]."""
        M, N = h.shape[0], h.shape[1] // 2
        y = torch.empty((M, N), dtype=h.dtype, device=h.device)
        _silu_mul_kernel[(M, triton.cdiv(N, 1024))](h, h.stride(0), y, y.stride(0), N, BN=1024, num_warps=4, **self.launch(h.device))
        return y

    def qk_rope_write(
        self, qkv, start, tokens, heads, kv_heads, head_dim, q_norm, k_norm, eps, inv_freq, k_cache, v_cache, rows=None, lengths=None
    ):
        """See ``TorchOps.qk_rope_write``. Caches: [n, kv_heads, L, D] views with unit inner stride, or
        whole pools [R, kv_heads, L, D] with ``rows`` [n] (owner i writes row rows[i]); ``lengths`` [n]:
        owner i writes its first lengths[i] rows only."""
        M = qkv.shape[0]
        n = M // tokens
        q = torch.empty((n, tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device) if heads else qkv
        norm = k_norm is not None
        q_weight = q_norm if q_norm is not None else (k_norm if norm else inv_freq)  # unread when there is no Q
        _qk_rope_write_kernel[(M, heads + kv_heads)](
            qkv, qkv.stride(0), start, inv_freq, q_weight, k_norm if norm else inv_freq,
            q, k_cache, v_cache, rows if rows is not None else start, lengths if lengths is not None else start,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tokens, heads, kv_heads, eps, D=head_dim, NORM=norm,
            ROWS=rows is not None, LENGTHS=lengths is not None, num_warps=1 if head_dim <= 64 else 2, **self.launch(qkv.device),
        )
        return q if heads else None

    def attention(self, q, k_cache, v_cache, rows, q_positions, kv_len, causal, window):
        """``EagerKernels.attention`` over the valid slots only: q [n, Hq, T, D] -> [n, Hq, T, D].

        ``rows`` None: the caches are the owners' rows; else [n] cache rows of whole pools (read in
        place, no gather). GQA shares each K/V tile among its query heads. Cost follows ``kv_len``
        (device memory), not ``max_context``.
        """
        n, heads, T, D = q.shape
        kv_heads, L = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        plan = attention_plan(n, kv_heads, group, T, D, L, self.processors(q.device), self.splits)
        out = torch.empty((n, T, heads, D), dtype=q.dtype, device=q.device)
        grid = (plan.splits, n * kv_heads, plan.query_blocks)
        split = plan.splits > 1
        rows_total = plan.splits * n * kv_heads * plan.query_blocks * plan.block_q
        part = torch.empty((rows_total, D) if split else (1,), dtype=torch.float32, device=q.device)
        lse = torch.empty((rows_total,) if split else (1,), dtype=torch.float32, device=q.device)
        _attention_kernel[grid](
            q, q.stride(0), q.stride(1), q.stride(2), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), q_positions, q_positions.stride(0), kv_len, out, out.stride(0), out.stride(2),
            out.stride(1), part, lse, rows if rows is not None else kv_len, T, group, kv_heads, window, D**-0.5, D=D,
            BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, CAUSAL=causal, WINDOW=window > 0, SPLIT=split, ROWS=rows is not None,
            num_warps=4, num_stages=2, **self.launch(q.device),
        )
        if split:
            _combine_kernel[(n * kv_heads, plan.query_blocks, plan.block_q // 16)](
                part, lse, out, out.stride(0), out.stride(2), out.stride(1), T, group, kv_heads,
                D=D, BLOCK_Q=plan.block_q, SPLITS=plan.splits, SPLITS_P2=triton.next_power_of_2(plan.splits), ROWS=16,
                num_warps=4, **self.launch(q.device),
            )
        return out.transpose(1, 2)
