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

MAX_SPLITS = 32  # flash-decoding splits of one (owner, kv head, query block)
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
    """Enough programs to cover ``processors`` about twice; ``splits`` overrides the split count."""
    rows = tokens * group
    block_q = min(ATTENTION_BLOCK_Q, max(16, next_power_of_two(rows)))
    block_n = 64 if head_dim <= 128 else 32
    query_blocks = cdiv(rows, block_q)
    if splits is None:
        programs = owners * kv_heads * query_blocks
        splits = max(1, min(MAX_SPLITS, (2 * processors) // programs, cdiv(max_context, block_n)))
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
    """Tiling of the skinny GEMM ``y[M, N] = x[M, K] @ W[N, K]^T``.

    ``dot=False`` (one row only): a broadcast multiply-accumulate over a
    [block_n, block_k] weight tile, reduced once at the end (no tensor cores:
    at M = 1 they would compute 15 padding rows).
    """

    block_m: int
    block_n: int
    block_k: int
    dot: bool
    warps: int
    stages: int


def linear_plan(rows: int, out_features: int, in_features: int, gated: bool, element_bytes: int) -> LinearPlan:
    """Weight-streaming tiles: every weight byte is read once; small blocks along N keep the chip busy."""
    wide = element_bytes >= 4  # fp32 tiles take twice the shared memory
    if rows == 1:
        return LinearPlan(1, 16 if gated else 32, 128 if wide else 256, False, 4, 4)
    if rows <= 16:
        return LinearPlan(16, 32, 64 if wide else 128, True, 4, 4)
    if rows <= 64:
        return LinearPlan(64, 32 if gated else 64, 32 if wide else 64, True, 4, 3 if wide else 4)
    return LinearPlan(64, 64 if gated else 128, 32 if wide else 64, True, 8, 3)
