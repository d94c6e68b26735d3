"""Launch plans of the fast kernels: pure functions of static shapes (no device, no torch).

Both implementations of the kernels (``triton_ops`` on CUDA, ``torch_ops``
its pure-torch twin) take their tiling from here, so the twin computes the
same splits the CUDA kernels do and tests on the CPU exercise that math.

Nothing here may depend on a length that lives in device memory (``kv_len``,
``start``): a plan is fixed when a CUDA graph is captured and must hold for
every replay. The attention plan therefore fixes the NUMBER of key splits and
each program derives its slot range from the device-side length at run time:
the work per call follows the valid slots, never ``max_context``.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SPLITS = 16  # flash-decoding splits of one (owner, kv head, query block)
ATTENTION_BLOCK_Q = 64  # query rows (token x grouped head) of one attention program, at most


def next_power_of_two(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AttentionPlan:
    """Tiling of attention over cache rows.

    A program owns one owner, one kv head (all ``group`` query heads that
    share it: GQA without repeating K/V), ``block_q`` query rows (row
    ``r = t * group + g``) and one of ``splits`` slices of the valid slot
    range; slices are combined by their log-sum-exp when ``splits > 1``.
    """

    block_q: int
    block_n: int
    query_blocks: int
    splits: int


def attention_plan(
    owners: int, kv_heads: int, group: int, tokens: int, head_dim: int, max_context: int, processors: int, splits: int | None = None
) -> AttentionPlan:
    """About one program per processor (the combine reads every split); ``splits`` overrides the split count."""
    rows = tokens * group
    block_q = min(ATTENTION_BLOCK_Q, max(16, next_power_of_two(rows)))
    block_n = 64 if head_dim <= 128 else 32
    query_blocks = cdiv(rows, block_q)
    if splits is None:
        programs = owners * kv_heads * query_blocks
        splits = max(1, min(MAX_SPLITS, processors // programs, cdiv(max_context, block_n)))
    return AttentionPlan(block_q, block_n, query_blocks, splits)


def split_range(lo: int, hi: int, split: int, splits: int, block_n: int) -> tuple[int, int]:
    """Slots [a, b) of ``split`` when the valid range [lo, hi) is cut into ``splits`` block-aligned slices.

    The same integer formula runs inside the attention kernel on device lengths.
    """
    width = max(hi - lo, 0)
    chunk = cdiv(cdiv(width, splits), block_n) * block_n
    a = lo + split * chunk
    return a, min(a + chunk, hi)


@dataclass(frozen=True)
class LinearPlan:
    """Tiling of the one-row GEMV ``y[N] = x[K] @ W[N, K]^T`` (the decode step's GEMMs).

    A program owns ``block_n`` output features and streams their weight rows in
    [block_n, block_k] tiles. ``early_sum``: reduce each tile into the [block_n]
    accumulator at once (few registers, many programs resident: more bytes in
    flight) instead of keeping a [block_n, block_k] fp32 accumulator.
    Rows > 1 go through cuBLAS with fused elementwise kernels around it (measured
    faster than these tiles from M = 16 on, H200).
    """

    block_n: int
    block_k: int
    warps: int
    early_sum: bool


def linear_plan(out_features: int, in_features: int, gated: bool, element_bytes: int) -> LinearPlan:
    """The best of ``benchmarks/gpu_graphs.py --sweep`` on an H200 at the Qwen3-8B shapes (bf16).

    Square-ish weights with few rows (o_proj 4096x4096, down_proj 4096x12288) want many thin programs;
    wide ones (gate|up, the LM head) 32-row tiles; q|k|v a 16x512 tile with a 2-D accumulator.
    """
    if element_bytes >= 4:
        return LinearPlan(16, 128, 4, True)
    if gated or out_features >= 65536:
        return LinearPlan(32, 256, 4, True)
    if out_features <= in_features:
        return LinearPlan(4, 1024, 4, True)
    return LinearPlan(16, 512, 4, False)
