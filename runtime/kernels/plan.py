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


# ---------------------------------------------------------------------- exact kernels
#
# Tilings of ``exact_ops``: functions of the WEIGHT or HEAD shape only, never of the row count, the
# query count, the owner count or the cache capacity, so each row is reduced in one fixed order.

EXACT_TILE_M = 16  # rows of one MMA tile of the exact linear (a single row is padded to it)
EXACT_BLOCK_Q = 16  # query rows (token x grouped head) of one exact attention tile (they share its key loads)
EXACT_SPLIT_SLOTS = 256  # key slots of one exact attention split: split s holds slots [256 s, 256 (s + 1))
EXACT_PARTIAL_BYTES = 256 * 1024**2  # fp32 split partials of one exact attention launch, at most


EXACT_STAGE_BYTES = 160 * 1024  # shared memory the pipelined K steps of one exact linear program may hold
EXACT_SHARED_HEADROOM = 16 * 1024  # a program's shared memory beside its pipelined steps (layout changes, epilogues)
EXACT_SHARED_BYTES = 227 * 1024 - EXACT_SHARED_HEADROOM  # what an H100 / H200 program's pipelined steps may hold at most
EXACT_WORKSPACE_BYTES = 64 * 1024**2  # fp32 split-K partials of one exact linear launch, at most
EXACT_PROCESSORS = 132  # streaming multiprocessors the default tilings are written for (an H100 / H200 SXM)


@dataclass(frozen=True)
class ExactLinearPlan:
    """Tiling of the exact linear ``y[M, N] = x[M, K] @ W[N, K]^T``.

    A row's reduction order, fixed per weight: K is cut into ``splits`` ranges of ``exact_split_k``'s width
    (a multiple of ``block_k``), each walked in ``block_k`` steps from its start, one 16-row MMA tile of x per
    dot, fp32 accumulate; with splits > 1 each range's sum lands in an fp32 workspace and a second pass adds
    ranges 0, 1, .., S-1 in that order, then applies the epilogues (``fixup``: the tile's last range to finish
    does that pass inside the first launch; the same sums in the same order). ``warps`` and ``stages`` (0: the
    shared-memory rule of ``exact_linear_launch``) are fixed per weight too.
    The rest only says how the work is spread, never how a row is summed: ``block_n`` features per program for a few
    rows (M <= 8: many programs stream the weight), ``block_n_rows`` for more (fewer re-reads of x; at 16 rows, a
    one-owner verify, ``block_n`` ran the Qwen3-8B o and LM head 0.5 and 3 µs faster, q|k|v and gate|up 0.8 and 0.7
    µs slower, so taking it up to 16 rows made that verify slower: benchmarks/RESULTS.md, "The Qwen3-8B-shape cycle
    on an H200 at 563b941"), up to ``tiles`` (1, 2 or 4) 16-row tiles per program sharing each weight load
    (``exact_row_tiles``; four tiles cost registers). Each output element is one MMA column's sum over the same K
    steps whatever the feature block (tests/runtime/test_exact_kernels.py compiles the variants for sm90 and
    compares their MMA layouts).
    """

    block_n: int
    block_n_rows: int
    block_k: int
    warps: int
    splits: int = 1
    stages: int = 0
    fixup: bool = False
    tiles: int = 4

    def fields(self) -> list:
        """The table row (``EXACT_TILES``, the sweep's JSON): block_n, block_n_rows, block_k, warps, splits, stages,
        fixup, tiles."""
        return [self.block_n, self.block_n_rows, self.block_k, self.warps, self.splits, self.stages, self.fixup, self.tiles]


# (N, K, gated, element bytes, processors) -> the tiling measured best there by ``benchmarks/exact_kernels.py
# --sweep`` (its JSON ``table``); weights not listed take ``exact_linear_plan``'s rule.
EXACT_TILES: dict[tuple[int, int, bool, int, int], ExactLinearPlan] = {
    # The Qwen3-8B weights on an H200 (132 SMs), bf16; benchmarks/RESULTS.md "exact_kernels" (sweeps of 2026-12-01,
    # and of 2026-12-02 with the norm as its own pass: q|k|v and the LM head changed). gate|up and q|k|v held two
    # tiles a program until the wide tiles (``ExactOps.wide_tiles``): with them four tie at 64 rows and win at 128
    # (H100: gate|up 86.1 against 112.3 µs, q|k|v 36.0 against 43.2; RESULTS.md "One 64-row tile on Hopper's
    # warp-group MMA").
    (12288, 4096, True, 2, 132): ExactLinearPlan(32, 64, 64, 4, 1, 0, False, 4),  # gate|up
    (4096, 12288, False, 2, 132): ExactLinearPlan(64, 64, 128, 4, 4, 0, True, 4),  # down
    (6144, 4096, False, 2, 132): ExactLinearPlan(32, 64, 128, 4, 2, 0, True, 4),  # q|k|v
    (4096, 4096, False, 2, 132): ExactLinearPlan(32, 64, 128, 4, 2, 0, True, 4),  # o
    (151936, 4096, False, 2, 132): ExactLinearPlan(64, 128, 128, 4, 1, 0, False, 4),  # the LM head
}


def exact_linear_plan(out_features: int, in_features: int, gated: bool, element_bytes: int, processors: int = EXACT_PROCESSORS) -> ExactLinearPlan:
    """The tiling of one weight: a function of its shape and the processor count, never of the row count.

    ``EXACT_TILES`` first; else bf16: feature blocks of 16 (N <= K), 32 (gate|up, q|k|v) or 64 (the LM head)
    and K cut into the fewest splits (1, 2, 4 or 8, each at least 8 K steps) that give one row ~4 programs
    per processor: the 16-row tiles stream the weight at a fraction of the bandwidth per program, so a
    one-row launch needs many in flight. fp32 (FMA dots): small tiles, no split.
    """
    table = EXACT_TILES.get((out_features, in_features, gated, element_bytes, processors))
    return table if table is not None else exact_linear_rule(out_features, in_features, gated, element_bytes, processors)


def exact_linear_rule(out_features: int, in_features: int, gated: bool, element_bytes: int, processors: int) -> ExactLinearPlan:
    """``exact_linear_plan`` for a weight the table does not list."""
    if element_bytes >= 4:
        return ExactLinearPlan(16, 32, 32, 4)
    if out_features >= 65536:
        block_n, rows = 64, 128
    elif gated or out_features > in_features:
        block_n, rows = 32, 64
    else:
        block_n, rows = 16, 64
    splits, programs = 1, cdiv(out_features, block_n)
    while splits < 8 and programs * splits < 4 * processors and in_features >= 2 * splits * 8 * 128:
        splits *= 2
    return ExactLinearPlan(block_n, rows, 128, 4, splits)


def exact_split_k(in_features: int, plan: ExactLinearPlan) -> tuple[int, int]:
    """(splits, K per split) of a weight: ranges of a whole number of ``block_k`` steps, the last one cut
    at K; fewer than ``plan.splits`` when K has fewer steps (no empty range)."""
    steps = cdiv(in_features, plan.block_k)
    width = cdiv(steps, max(1, min(plan.splits, steps))) * plan.block_k
    return cdiv(in_features, width), width


def exact_workspace_rows(rows: int, splits: int, columns: int, budget: int = EXACT_WORKSPACE_BYTES) -> int:
    """Rows of one split-K launch (a multiple of 64, at least 64; at most ``rows`` rounded up to 16): its
    fp32 partials [splits, rows, columns] fit ``budget`` when 64 rows do. Longer inputs run as more
    launches: the same arithmetic per row."""
    fit = budget // (splits * columns * 4) // 64 * 64
    return min(max(64, fit), cdiv(rows, EXACT_TILE_M) * EXACT_TILE_M)


def exact_linear_launch(plan: ExactLinearPlan, rows: int, gated: bool, element_bytes: int, out_features: int | None = None,
                        processors: int = EXACT_PROCESSORS, shared: int = EXACT_SHARED_BYTES, x_bytes: int | None = None) -> tuple[int, int, int]:
    """(16-row tiles per program, features per program, pipeline stages) for ``rows`` rows: spread only
    (the stages: the plan's, else as many as fit ``EXACT_STAGE_BYTES``, 2 to 4).

    ``shared``: what a program's pipelined steps may hold on this GPU (``EXACT_SHARED_BYTES`` on an H100 /
    H200; ~83 KiB on an sm86 / sm89 GPU). Less than ``EXACT_STAGE_BYTES`` lowers the stages' target to it; where
    even two stages do not fit, fewer tiles share a weight load, then the feature block narrows, until they do
    (all spread: the K steps, so the sums, stay the weight's). ``x_bytes``: x's element size where it is not the
    weight's (an fp8 weight under bf16 rows).

    With ``out_features``, a small weight under many rows is spread wider: while the launch has fewer
    programs than three quarters of the ``processors``, fewer tiles share a weight load (4 -> 2 -> 1), then,
    below half of them, the few-row feature block. A tiny model's verify (N = 320..896, 256 rows) otherwise runs
    as 20..60 programs of four tiles each, most processors idle; the Qwen3-8B weights have enough programs
    already and keep their spread."""
    tiles = exact_row_tiles(rows, plan.tiles)
    block_n = plan.block_n if rows <= EXACT_TILE_M // 2 else plan.block_n_rows
    if out_features is not None:
        tiles, block_n = exact_wider_spread(plan, rows, tiles, block_n, out_features, processors)
    step = _linear_step_bytes(plan, tiles, block_n, gated, element_bytes, x_bytes)
    if plan.stages and plan.stages * step <= shared:
        return tiles, block_n, plan.stages
    while 2 * step > shared and (tiles > 1 or block_n > 16):
        tiles, block_n = (tiles // 2, block_n) if tiles > 1 else (tiles, block_n // 2)
        step = _linear_step_bytes(plan, tiles, block_n, gated, element_bytes, x_bytes)
    return tiles, block_n, max(2, min(4, min(EXACT_STAGE_BYTES, shared) // step))


def _linear_step_bytes(plan: ExactLinearPlan, tiles: int, block_n: int, gated: bool, element_bytes: int, x_bytes: int | None = None) -> int:
    """Shared memory of one pipelined K step of an exact linear program: its weight block(s) and x tiles."""
    x_bytes = element_bytes if x_bytes is None else x_bytes
    return ((2 if gated else 1) * block_n * element_bytes + tiles * EXACT_TILE_M * x_bytes) * plan.block_k


def exact_wider_spread(plan: ExactLinearPlan, rows: int, tiles: int, block_n: int, out_features: int, processors: int) -> tuple[int, int]:
    """``exact_linear_launch``'s widening: (tiles, feature block) where the plan's spread leaves processors idle
    (how work is spread: a row's sums are the same). Fewer tiles per program until the launch has 3/4 of
    ``processors`` programs; then the few-row feature block, if it still has fewer than half. Measured on the
    default pair's weights (benchmarks/RESULTS.md, exact_spread): at 1,024 rows o and down ran 16% and 21%
    faster with two tiles per program (160 programs) than with four (80); narrower feature blocks only pay below half."""
    def programs(t: int, bn: int) -> int:
        return cdiv(rows, t * EXACT_TILE_M) * cdiv(out_features, bn) * plan.splits

    while tiles > 1 and programs(tiles, block_n) * 4 < processors * 3:
        tiles //= 2
    if programs(tiles, block_n) * 2 < processors and block_n > plan.block_n:
        block_n = plan.block_n
    return tiles, block_n


def exact_row_tiles(rows: int, most: int = 4) -> int:
    """16-row tiles per program (1, 2 or 4, at most ``most``): how many tiles share each weight load; never the
    arithmetic."""
    return min(most, 1 if rows <= EXACT_TILE_M else 2 if rows <= 2 * EXACT_TILE_M else 4)


def exact_attention_block_n(head_dim: int) -> int:
    """Key slots per inner step of the exact attention (a divisor of ``EXACT_SPLIT_SLOTS``)."""
    return 64 if head_dim <= 128 else 32


def exact_attention_stages(head_dim: int, element_bytes: int, block_n: int | None = None, shared: int = EXACT_SHARED_BYTES) -> int:
    """Key / value steps in flight per exact attention program: 3 where their tiles fit ``EXACT_STAGE_BYTES``
    of shared memory and ``shared`` (``exact_linear_launch``'s), else 2, else 1. The depth moves loads, never
    sums (the same bits at every depth); a split's few steps otherwise wait one memory round trip each (H200,
    Qwen3-8B shape, context 2048: 12.3 against 13.7 µs per layer at one query; 4 steps in flight lose at
    16 x 4 queries, 48.6 against 38.9: benchmarks/RESULTS.md, "the exact attention's loads in flight")."""
    block_n = block_n or exact_attention_block_n(head_dim)
    tiles = 2 * block_n * head_dim * element_bytes  # one step's keys and values
    budget = min(EXACT_STAGE_BYTES, shared)
    return 3 if 3 * tiles <= budget else 2 if 2 * tiles <= budget else 1


EXACT_ATTENTION_REGISTERS = 128  # a crowded attention launch's registers per thread: four programs of four warps per SM
EXACT_ATTENTION_PROGRAMS = 3  # programs per SM the uncapped attention holds (146 registers, 70 KiB at three steps)


def exact_attention_launch(programs: int, processors: int, stages: int) -> tuple[int, int | None]:
    """(key / value steps in flight, register cap or None) of one exact attention launch of ``programs`` programs
    (units x the grid's splits) on ``processors`` SMs, whose uncapped programs would run ``stages`` steps in flight.

    The kernel is bound by latency at every shape (benchmarks/RESULTS.md, "The exact attention: split windows ...":
    0.15-0.46 instructions issued per cycle, 14-43% of DRAM): more warps per scheduler is what a launch of more
    programs than ``EXACT_ATTENTION_PROGRAMS`` per SM lacks. There it runs at two steps in flight (38 KiB of
    shared memory) and at most ``EXACT_ATTENTION_REGISTERS`` registers (no spills under Triton 3.6 for sm90): four
    programs per SM instead of three. Loads and registers only: the same bits either way. Measured on an H100 at
    context 2048 (benchmarks/RESULTS.md, "The crowded attention launch's cap measured"): the four-owner verify's
    attention 34.5 against 38.8 µs per layer; the other capped shapes within ±0.6 µs of uncapped."""
    if programs > EXACT_ATTENTION_PROGRAMS * processors and stages >= 2:
        return 2, EXACT_ATTENTION_REGISTERS
    return stages, None


def exact_split_count(max_context: int, split_slots: int = EXACT_SPLIT_SLOTS) -> int:
    """Splits of the exact attention grid: enough for a full cache; the ones past the valid slots exit."""
    return cdiv(max_context, split_slots)


def exact_units_per_launch(units: int, splits: int, head_dim: int, budget: int = EXACT_PARTIAL_BYTES, block_q: int = EXACT_BLOCK_Q) -> int:
    """(owner x kv head x query block) units of one exact attention launch whose fp32 partials
    ([units, splits, block_q, head_dim] + their log-sum-exps) fit ``budget`` bytes (at least one)."""
    per_unit = splits * block_q * (head_dim + 1) * 4
    return max(1, min(units, budget // per_unit))


def exact_split_range(lo: int, hi: int, split: int, split_slots: int, block_n: int) -> tuple[int, int]:
    """Slots [a, b) that split ``split`` visits for the valid range [lo, hi): its fixed window
    [split * split_slots, (split + 1) * split_slots) cut to [lo rounded down to block_n, hi).

    The same integer formula runs inside the exact attention kernel on device lengths; a row's splits and
    the inner steps inside them start at the same absolute slots whatever else shares the launch.
    """
    first = max(split * split_slots, lo // block_n * block_n)
    return first, max(first, min((split + 1) * split_slots, hi))
