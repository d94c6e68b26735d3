"""The exact kernels (runtime/kernels/exact_ops.py): rows that don't depend on the batch, so DFlash equals plain decoding.

CPU: the tiling rules (plan.py, pure functions) and, where Triton is importable, the Triton kernels
themselves through Triton's interpreter in one subprocess (``TRITON_INTERPRET=1``): a row's linear
output and a query's attention are the same BITS with M = 1 / 5 / 16 / 64 rows at any place, 1 or 16
queries per owner, 1 or 3 owners, two cache capacities, views or pools, fp32 and bf16; and they agree
with the reference modules within bf16 rounding. GPU (``-m gpu``): the same on CUDA at the Qwen3-8B
weight shapes, and the executor: bf16 DFlash output == plain decoding token for token (greedy and
sampled with the same seeds) on the tiny pair and on the shipped default pair at 1, 4 and 16 sessions,
and through the serving loop: a request beside 63 others (DFlash) == the same request alone (plain).

    python -m pytest -q -m gpu tests/runtime/test_exact_kernels.py     # on the GPU machine
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from interpreted import results as interpreted_results

from dflash_trt.errors import EngineError
from dflash_trt.runtime.backends.torch_backend import choose_kernels
from dflash_trt.runtime.kernels.plan import (
    EXACT_SHARED_BYTES,
    EXACT_SHARED_HEADROOM,
    EXACT_SPLIT_SLOTS,
    EXACT_STAGE_BYTES,
    EXACT_TILES,
    ExactLinearPlan,
    exact_attention_block_n,
    exact_linear_launch,
    exact_linear_plan,
    exact_linear_rule,
    exact_row_tiles,
    exact_split_k,
    exact_split_range,
    exact_units_per_launch,
    exact_workspace_rows,
)

gpu = pytest.mark.gpu
TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="needs triton (it ships with the CUDA builds of torch)")


# ------------------------------------------------------------------ the rules (pure)


def test_exact_split_windows_sit_at_absolute_slots():
    """Bug: a query's key splits or inner steps start at slots that follow the launch (the tile's range, the
    query count, the capacity): its softmax is then summed in another order when decoded alone than inside a
    verify block, and bf16 DFlash drifts from plain decoding. Every split must start at a multiple of the
    split size (or at the range's first step), every step at a multiple of BLOCK_N, and the splits of any
    narrower range [lo', hi') must be the same windows cut to it."""
    block = exact_attention_block_n(128)
    for lo, hi in itertools.product((0, 3, 64, 250, 700), (0, 5, 256, 257, 600, 1000)):
        splits = -(-max(hi, 1) // EXACT_SPLIT_SLOTS)
        ranges = [exact_split_range(lo, hi, s, EXACT_SPLIT_SLOTS, block) for s in range(splits + 2)]  # + past the end
        seen = [slot for a, b in ranges for slot in range(a, b)]
        first = lo // block * block
        assert seen == list(range(first, max(hi, first))), (lo, hi)
        for s, (a, b) in enumerate(ranges):
            assert a % block == 0 and (a == s * EXACT_SPLIT_SLOTS or a == first or a == b), (lo, hi, s, a)
            for lo2, hi2 in ((lo + 70, hi), (lo, hi - 70), (lo + 5, hi - 5)):  # one row of the tile: a narrower range
                a2, b2 = exact_split_range(lo2, hi2, s, EXACT_SPLIT_SLOTS, block)
                assert a2 >= a and b2 <= max(b, a2) and (a2 - a) % block == 0, (lo, hi, lo2, hi2, s)


WEIGHTS_8B = {  # name: (N, K, gated, norm prologue) of the Qwen3-8B step
    "qkv": (6144, 4096, False, True), "o": (4096, 4096, False, False), "gate_up": (12288, 4096, True, True),
    "down": (4096, 12288, False, False), "lm_head": (151936, 4096, False, True),
}
WEIGHTS_DEFAULT_PAIR = {  # the embedded default pair's target (hidden 320, FFN 896, 5 / 1 heads x 64, vocab 8192)
    "qkv": (448, 320, False, True), "o": (320, 320, False, False), "gate_up": (896, 320, True, True),
    "down": (320, 896, False, False), "lm_head": (8192, 320, False, True),
}
ROW_COUNTS = (1, 4, 5, 16, 17, 33, 64, 240, 256, 300)  # decode (1..n owners), verify (16 x n), draft (15 x n), prefill chunks


def test_exact_launches_follow_the_rows_only_in_how_work_is_spread():
    """Bug: the linear's K step is chosen from the row count (the decode step, M = owners, and the verify,
    M = 16 x owners, would reduce a row in different orders); or the spread (tiles per program, feature
    block, pipeline stages) leaves its bounds: 1, 2 or 4 tiles, the plan's two feature blocks, 2..4 stages
    that fit the shared-memory budget."""
    for dtype_bytes in (2, 4):
        for N, K, gated, _ in WEIGHTS_8B.values():
            plan = exact_linear_plan(N, K, gated, dtype_bytes)
            assert plan.block_k >= 16 and min(plan.block_n, plan.block_n_rows) >= 16
            for M in ROW_COUNTS:
                tiles, block_n, stages = exact_linear_launch(plan, M, gated, dtype_bytes)
                assert tiles == exact_row_tiles(M, plan.tiles) and block_n == (plan.block_n if M <= 8 else plan.block_n_rows)
                stage = _step_bytes(plan, tiles, block_n, gated, dtype_bytes)
                assert 2 <= stages <= 4 and (stages == 2 or stages * stage <= EXACT_STAGE_BYTES)
    assert [exact_row_tiles(m) for m in (1, 5, 16, 17, 32, 33, 64, 1000)] == [1, 1, 1, 2, 2, 4, 4, 4]
    for N, K, gated, _ in WEIGHTS_8B.values():  # enough programs already: the widening leaves the 8B spread as it was
        plan = exact_linear_plan(N, K, gated, 2)
        assert all(exact_linear_launch(plan, M, gated, 2, N, 132) == exact_linear_launch(plan, M, gated, 2)
                   for M in ROW_COUNTS), N
    assert [exact_row_tiles(m, 2) for m in (1, 17, 64)] == [1, 2, 2] and exact_row_tiles(64, 1) == 1
    assert exact_linear_launch(ExactLinearPlan(32, 64, 128, 4, tiles=2), 64, True, 2)[0] == 2
    assert exact_linear_launch(ExactLinearPlan(32, 64, 128, 4, 2, 3), 64, True, 2)[2] == 3  # a table's stages win


def test_a_small_weight_under_many_rows_is_spread_over_the_processors():
    """Bug: a small weight under many rows runs as a few programs of four tiles each (the default pair's verify at
    16 owners: 256 rows of q|k|v as 28 programs on 132 processors), so the exact cycle's linears take twice
    cuBLAS's time; or the widening leaves the spread's bounds (1, 2 or 4 tiles, the plan's two feature blocks).
    Checked against the first spread found by brute force, in the order tiles 4 -> 2 -> 1, with at least 3/4 as
    many programs as processors, then the few-row block where one tile per program still has fewer than half."""
    processors = 132
    for N, K, gated, _ in WEIGHTS_DEFAULT_PAIR.values():
        plan = exact_linear_plan(N, K, gated, 2)
        for M in (*ROW_COUNTS, 512, 960, 1024, 2048):
            base = exact_linear_launch(plan, M, gated, 2)
            programs = lambda t, bn: -(-M // (16 * t)) * -(-N // bn) * plan.splits  # noqa: E731
            tiles_order = [(t, base[1]) for t in (4, 2, 1) if t <= base[0]]
            expected = next((c for c in tiles_order if 4 * programs(*c) >= 3 * processors), tiles_order[-1])
            if expected[0] == 1 and 2 * programs(*expected) < processors:
                expected = (1, plan.block_n)
            tiles, block_n, stages = exact_linear_launch(plan, M, gated, 2, N, processors)
            assert (tiles, block_n) == expected, (N, K, M)
            stage = ((2 if gated else 1) * block_n + 16 * tiles) * plan.block_k * 2
            assert 2 <= stages <= 4 and (stages == 2 or stages * stage <= EXACT_STAGE_BYTES)
    qkv = exact_linear_plan(448, 320, False, 2)
    assert exact_linear_launch(qkv, 256, False, 2)[:2] == (4, 64) and exact_linear_launch(qkv, 256, False, 2, 448, 132)[:2] == (1, 64)


def test_exact_split_k_is_fixed_per_weight_and_covers_k():
    """Bug: the split-K count or width follows the row count (a one-row decode step split 4 ways, a 64-row verify
    not: the same row summed in two orders), leaves a K step out or counts one twice, or starts a split off a
    BLOCK_K boundary; or a one-row launch of the rule's plan gets too few programs to stream the weight."""
    for processors in (78, 114, 132):
        for N, K, gated, _ in WEIGHTS_8B.values():
            plan = exact_linear_rule(N, K, gated, 2, processors)
            splits, width = exact_split_k(K, plan)
            assert width % plan.block_k == 0 and (splits - 1) * width < K <= splits * width, (N, K, plan)
            ranges = [(s * width, min(s * width + width, K)) for s in range(splits)]
            assert all(a < b for a, b in ranges) and ranges[0][0] == 0 and ranges[-1][1] == K
            assert all(b == c for (_, b), (c, _) in itertools.pairwise(ranges)), ranges
            assert plan.splits in (1, 2, 4, 8) and width >= 8 * plan.block_k
            programs = -(-N // plan.block_n) * splits  # at M = 1
            assert programs >= 4 * processors or plan.splits == 8 or K < 2 * plan.splits * 8 * plan.block_k, (N, K, plan)
    assert exact_split_k(4096, ExactLinearPlan(16, 64, 128, 4, 3)) == (3, 1408)  # 32 steps: 11 + 11 + 10
    assert exact_split_k(200, ExactLinearPlan(16, 64, 128, 4, 8)) == (2, 128)  # no empty split
    assert exact_linear_plan(6144, 4096, False, 4) == ExactLinearPlan(16, 32, 32, 4)  # fp32: no split
    for N, K, gated, _ in WEIGHTS_8B.values():  # the table (a sweep's winners), else the rule: never a row count
        key = (N, K, gated, 2, 132)
        assert exact_linear_plan(*key) == EXACT_TILES.get(key, exact_linear_rule(*key))


def test_exact_linear_table_entries_win_over_the_rule(monkeypatch):
    """Bug: the sweep's table (EXACT_TILES) is ignored, or applied on a GPU with another processor count
    (its split counts were measured for that many processors)."""
    tuned = ExactLinearPlan(64, 128, 64, 8, 2, 3)
    monkeypatch.setitem(EXACT_TILES, (6144, 4096, False, 2, 132), tuned)
    assert exact_linear_plan(6144, 4096, False, 2, 132) == tuned
    assert exact_linear_plan(6144, 4096, False, 2, 114) != tuned


def test_exact_workspace_rows_fit_the_budget():
    """Bug: the split-K partials of a long prefill chunk are allocated whole (splits x rows x N fp32: gigabytes for
    the LM head), or a launch's rows are not whole 16-row tiles."""
    assert exact_workspace_rows(1, 4, 6144) == 16 and exact_workspace_rows(64, 4, 6144) == 64
    rows = exact_workspace_rows(4096, 2, 2 * 12288, budget=64 * 1024**2)
    assert rows % 64 == 0 and rows * 2 * (2 * 12288) * 4 <= 64 * 1024**2 and rows >= 64
    assert exact_workspace_rows(4096, 8, 151936, budget=1) == 64  # at least 64 rows, whatever the budget


class _Recorder:
    """Stands in for a Triton kernel: records each launch's grid, arguments and options."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@needs_triton
def test_exact_linear_launches_sum_every_row_in_one_order(monkeypatch):
    """Bug: ``ExactOps.linear`` passes the kernel another split count, split width, K step, warp count or
    workspace layout for another row count (M = 1 decode vs 16 x n verify vs a prefill chunk), or its launches
    skip or repeat rows. Every launch of every M must carry the weight's own arithmetic and the row chunks
    must tile [0, M) in order; the second pass runs exactly when the weight is split; the norm runs once, over
    every row, before them (not per launch, not skipped)."""
    from dflash_trt.runtime.kernels import exact_ops

    for plan in (ExactLinearPlan(16, 64, 128, 4, 4), ExactLinearPlan(32, 64, 64, 8, 1), ExactLinearPlan(16, 32, 128, 4, 3, 2, True)):
        seen = set()
        for M in ROW_COUNTS + (1000,):
            linear, total, norms = _Recorder(), _Recorder(), []
            monkeypatch.setattr(exact_ops, "_linear_kernel", linear)
            monkeypatch.setattr(exact_ops, "_split_sum_kernel", total)
            monkeypatch.setattr(exact_ops.ExactOps, "rms_norm", lambda self, x, weight, eps, norms=norms: norms.append(tuple(x.shape)) or x)
            ops = exact_ops.ExactOps(linear_plans={(256, 4096, True): plan}, workspace_bytes=2 * 1024**2)
            x = torch.zeros(M, 4096, dtype=torch.bfloat16)
            ops.linear(x, torch.zeros(512, 4096, dtype=torch.bfloat16), norm=torch.ones(4096, dtype=torch.bfloat16), gated=True)
            assert norms == [(M, 4096)]  # the norm pass: once, over every row, before any launch of the product
            starts = []
            for grid, args, kwargs in linear.launches:
                ws_rows, row0, end, K, width = args[13], args[15], args[16], args[18], args[19]
                assert grid[2] == kwargs["SPLITS"] and end - row0 <= ws_rows and end <= M and K == 4096
                seen.add((kwargs["SPLITS"], width, kwargs["BK"], kwargs["num_warps"], kwargs["TM"], ws_rows if M == 1 else None))
                starts.append((row0, end))
            assert [a for a, _ in starts] == list(range(0, M, starts[0][1] - starts[0][0])) and starts[-1][1] == M
            assert len(total.launches) == (len(starts) if kwargs["SPLITS"] > 1 and not kwargs["FIXUP"] else 0)
        arithmetic = {key[:5] for key in seen}
        assert len(arithmetic) == 1, (plan, arithmetic)


def test_exact_attention_partials_fit_their_budget():
    """Bug: a long-context prefill allocates the split partials of every (owner, head, query tile) at once
    (splits x rows x head_dim fp32: gigabytes at 40k slots): launches must be cut to the budget, at least one unit."""
    assert exact_units_per_launch(10, 16, 128) == 10
    units = exact_units_per_launch(16384, 160, 128, budget=256 * 1024**2)
    assert 1 <= units < 16384 and units * 160 * 16 * 129 * 4 <= 256 * 1024**2
    assert exact_units_per_launch(5, 10**6, 128, budget=1) == 1


def _stub_pair(head_dim: int = 16):
    """What ``choose_kernels`` reads of a pair: the head dims."""
    model = SimpleNamespace(config=SimpleNamespace(head_dim=head_dim))
    return model, model


def test_exact_kernels_option_is_checked(monkeypatch):
    """Bug: kernels="exact" silently falls back to the fast or eager path (the guarantee quietly lost), runs a
    pair its kernels cannot (head_dim not a power of two), or launches Triton on CPU tensors without the
    interpreter (a crash inside Triton instead of a typed error)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineError, match="needs a CUDA device"):
        choose_kernels("exact", torch.device("cpu"), *_stub_pair(), "bfloat16")
    with pytest.raises(EngineError, match="head_dim must be a power of two"):
        choose_kernels("exact", torch.device("cpu"), *_stub_pair(head_dim=12), "bfloat16")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_kernels("exact", torch.device("cpu"), *_stub_pair(), "bfloat16") == "exact"
    assert choose_kernels("auto", torch.device("cpu"), *_stub_pair(), "bfloat16") == "eager"  # the reference modules on the CPU
    assert choose_kernels("fast", torch.device("cpu"), *_stub_pair(), "bfloat16") == "fast"


def test_auto_kernels_are_exact_in_bf16_on_cuda():
    """Bug: "auto" on CUDA picks the fast kernels in bf16, whose reduction orders follow the batch, so bf16
    DFlash output silently drifts from plain decoding; or picks the exact ones for fp32 / fp16, where they
    were never measured; or for a pair the fused kernels cannot run (a crash instead of the eager modules)."""
    cuda = torch.device("cuda")
    assert choose_kernels("auto", cuda, *_stub_pair(), "bfloat16") == "exact"
    assert choose_kernels("auto", cuda, *_stub_pair(), "float32") == "fast"
    assert choose_kernels("auto", cuda, *_stub_pair(), "float16") == "fast"
    assert choose_kernels("auto", cuda, *_stub_pair(head_dim=12), "bfloat16") == "eager"
    assert choose_kernels("fast", cuda, *_stub_pair(), "bfloat16") == "fast"  # asked for: kept


@needs_triton
def test_an_exact_ops_object_reports_exact():
    """Bug: TorchBackend(kernels=ExactOps(...)) reports "fast" (logs and benchmarks mislabel the run)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    assert choose_kernels(ExactOps(split_slots=128), torch.device("cuda"), *_stub_pair(), "bfloat16") == "exact"


@needs_triton
def test_wide_tiles_are_the_default_only_where_measured(monkeypatch):
    """Bug: the 64-row warp-group MMA tile (``ExactOps.wide_tiles``) runs where its bits were never compared with
    the 16-row tiles' (a GPU other than sm90, the CPU interpreter) or where it measured slower (fp8 weights), or an
    explicit choice is overridden by the default."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for capability, hopper in (((9, 0), True), ((8, 9), False), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        ops = ExactOps()
        assert ops.wide(cuda, scaled=False) is hopper, capability
        assert ops.wide(cuda, scaled=True) is False, capability
        assert ops.wide(cpu, scaled=False) is False
        assert ExactOps(wide_tiles=True).wide(cuda, scaled=True) is True
        assert ExactOps(wide_tiles=False).wide(cuda, scaled=False) is False


# ------------------------------------------------------------------ the kernels, compiled for sm90 (CPU)

SM89_SHARED_BYTES = 101376 - EXACT_SHARED_HEADROOM  # what an sm86 / sm89 program's pipelined steps may hold (ExactOps.shared_bytes)


def _step_bytes(plan, tiles: int, block_n: int, gated: bool, element_bytes: int) -> int:
    """One pipelined K step of an exact linear program (the reference): its weight block(s) and x tiles."""
    return ((2 if gated else 1) * block_n + 16 * tiles) * plan.block_k * element_bytes


LINEAR_ARGS = ("x_ptr", "stride_xm", "w_ptr", "stride_wn", "b_ptr", "s_ptr", "r_ptr", "stride_rm", "o_ptr", "stride_om",
               "t_ptr", "stride_tm", "ws_ptr", "WR", "cnt_ptr", "row0", "M", "N", "K", "KS")


def _ttgir(kernel, args: dict[str, str], aligned: set[str], constexprs: dict, warps: int, stages: int) -> str:
    """Triton's GPU IR of ``kernel`` compiled for an H100/H200 (sm90) here, no GPU, with the ``aligned``
    arguments known 16-divisible (as Triton specializes them at a launch) and the others not."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=args | {k: "constexpr" for k in constexprs}, constexprs=constexprs,
                       attrs={(i,): [["tt.divisibility", 16]] for i, name in enumerate(args) if name in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}).asm["ttgir"]


def _arithmetic(ir: str) -> tuple[tuple, frozenset]:
    """What orders a row's floating-point sums: the layouts every reduction runs in (in program order) and
    the MMA instructions (version, instruction shape) of every dot."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
    reductions = tuple(aliases.get(layout, layout) for layout in re.findall(r"\}\) : \(tensor<[^,]+, (#[\w]+)>\) -> ", ir))
    dots = [re.search(r"-> tensor<[0-9x]+xf32, (#\w+)>", line).group(1) for line in ir.splitlines()
            if " tt.dot " in line or " ttng.warp_group_dot " in line]  # mma.sync / Hopper's warp-group MMA
    mma = frozenset(re.sub(r"warpsPerCTA = \[[0-9, ]+\], ", "", aliases.get(d, d)) for d in dots)  # warps: who computes, not how
    return reductions, mma


@needs_triton
@pytest.mark.parametrize("scaled", [False, True], ids=["bf16", "fp8 weights"])
def test_exact_linear_compiles_to_one_arithmetic_for_every_row_count(scaled, monkeypatch):
    """Bug: a row count changes the compiled arithmetic of the exact linear: the feature block, the tiles per
    program or the pipeline stages it picks make Triton reduce in another layout (another order) or pick
    another MMA instruction than the launch's kind allows, and the decode step and the verify give a row other
    bits. Compiled for sm90 here as ``ExactOps`` launches it there, bf16, the Qwen3-8B weights and the default
    pair's (whose many-row launches are spread wider: fewer tiles, the few-row feature block), with the spreads of
    an H100 and of a GPU with 99 KiB of shared memory a program (fewer tiles and narrower blocks, so that two
    stages fit): every launch of one or two 16-row tiles a program compiles to the 16 x 8 ``mma.sync``; a launch of
    four computes them as one 64-row tile (``wide_tiles``), compiled to the warp-group MMA (``wgmma``, k = 16: the
    same K steps; that it rounds them as ``mma.sync`` does is the GPU's, compared bit for bit by the gpu-marked
    ``wide_rows`` check). With fp8 weights (the draft's ``draft_weights="fp8"``, never wide) every launch
    ``mma.sync``: a draft proposal must not depend on how many owners share the launch."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps, _linear_kernel

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))  # ExactOps' choices on an sm90 GPU
    wide_here = ExactOps().wide(torch.device("cuda", 0), scaled)
    args = {name: "*bf16" if name.endswith("_ptr") else "i32" for name in LINEAR_ARGS}
    args["ws_ptr"], args["cnt_ptr"] = "*fp32", "*i32"
    if scaled:
        args["w_ptr"], args["s_ptr"] = "*fp8e4nv", "*fp32"
    element_bytes = 1 if scaled else 2
    aligned = {name for name in LINEAR_ARGS if name not in ("M", "WR", "row0")}  # pointers, strides (K, N...), N, K of the 8B weights
    weights = [WEIGHTS_8B[name] for name in ("qkv", "gate_up", "down")] + list(WEIGHTS_DEFAULT_PAIR.values())
    wide_seen = False
    for N, K, gated, norm in weights:  # the 8B table's tilings: split (q|k|v, down) or not (gate|up); the rule's
        name = (N, K, gated)
        plan = exact_linear_plan(N, K, gated, element_bytes)
        compiled = {}
        launches = sorted({exact_linear_launch(plan, M, gated, element_bytes, N, processors, shared, 2) for M in ROW_COUNTS
                           for processors in (4, 132)
                           for shared in (EXACT_SHARED_BYTES, SM89_SHARED_BYTES)})
        fixups = (False, True) if plan.splits > 1 else (False,)
        for fixup, (tiles, block_n, stages) in itertools.product(fixups, launches):  # the in-kernel sum: spread only
            wide = tiles == 4 and wide_here  # as ExactOps.linear launches it
            constexprs = dict(GATED=gated, BIAS=False, RESIDUAL=not norm, TAP=False, SCALED=scaled, SPLITS=plan.splits, FIXUP=fixup,
                              TILES=1 if wide else tiles, TM=64 if wide else 16, BN=block_n, BK=plan.block_k, INTERP=False, PDL=False)
            try:
                ir = _ttgir(_linear_kernel, args, aligned, constexprs, plan.warps, stages)
            except Exception as error:  # noqa: BLE001 - a Triton without the NVIDIA backend's compiler
                pytest.skip(f"cannot compile for sm90 here: {error!r}"[:200])
            compiled[(fixup, tiles, block_n, stages)] = (wide, *_arithmetic(ir))
        reductions = {r for _, r, _ in compiled.values()}
        assert all(len(set(r)) <= 1 for r in reductions) and len({r[0] for r in reductions if r}) <= 1, (name, compiled)
        for wide, _, mma in compiled.values():
            assert len(mma) == 1, (name, compiled)
            if wide:
                assert re.search(r"versionMajor = 3, .*instrShape = \[16, \d+, 16\]", next(iter(mma))), (name, compiled)
            else:
                assert "versionMajor = 2" in next(iter(mma)) and "instrShape = [16, 8]" in next(iter(mma)), (name, compiled)
        wide_seen |= any(wide for wide, _, _ in compiled.values())
    assert wide_seen == (not scaled)  # the 8B weights' many-row launches run four tiles a program


def _launched_kernels() -> list[tuple]:
    """(kernel, argument types, constexprs) of every kernel the fast and exact ops launch (PDL left out)."""
    from dflash_trt.runtime.kernels import exact_ops, triton_ops

    ints = lambda *names: {name: "i32" for name in names}  # noqa: E731
    linear = {name: "*bf16" if name.endswith("_ptr") else "i32" for name in LINEAR_ARGS} | {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    sums = {"ws_ptr": "*fp32"} | ints("WR", "row0", "M", "N") | {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "s_ptr": "*bf16",
           "r_ptr": "*bf16", "stride_rm": "i32", "o_ptr": "*bf16", "stride_om": "i32", "t_ptr": "*bf16", "stride_tm": "i32"}
    fp8_linear = linear | {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    q = {"q_ptr": "*bf16"} | ints("sq_n", "sq_h", "sq_t") | {"k_ptr": "*bf16", "v_ptr": "*bf16"} | ints("sk_n", "sk_h", "sk_l")
    q |= {"pos_ptr": "*i64", "spos_n": "i32", "len_ptr": "*i64"}
    fast = q | {"o_ptr": "*bf16"} | ints("so_n", "so_h", "so_t") | {"part_ptr": "*fp32", "lse_ptr": "*fp32", "rows_ptr": "*i64"}
    fast |= ints("T", "G", "HKV", "window") | {"scale": "fp32"}
    exact = q | {"part_ptr": "*fp32", "lse_ptr": "*fp32", "rows_ptr": "*i64", "o_ptr": "*bf16"} | ints("so_n", "so_h", "so_t")
    exact |= {"cnt_ptr": "*i32"} | ints("unit0", "QB", "T", "G", "HKV", "window")
    exact |= {"scale": "fp32"}
    combine = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "o_ptr": "*bf16"} | ints("so_n", "so_h", "so_t")
    combine |= {"pos_ptr": "*i64", "spos_n": "i32", "len_ptr": "*i64"} | ints("unit0", "QB", "S", "T", "G", "HKV", "window")
    fast_combine = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "o_ptr": "*bf16"} | ints("so_n", "so_h", "so_t", "T", "G", "HKV")
    shape = dict(D=128, BLOCK_Q=16, BLOCK_N=64, CAUSAL=True, WINDOW=True)
    rope = {"qkv_ptr": "*bf16", "stride_m": "i32", "start_ptr": "*i64", "freq_ptr": "*fp32", "qn_ptr": "*bf16", "kn_ptr": "*bf16",
            "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "rows_ptr": "*i64", "len_ptr": "*i64"}
    rope |= ints("stride_cn", "stride_ch", "stride_cl", "T", "HQ", "HKV") | {"eps": "fp32"}
    gemv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "stride_wn": "i32", "b_ptr": "*bf16", "g_ptr": "*bf16", "r_ptr": "*bf16",
            "o_ptr": "*bf16", "t_ptr": "*bf16"} | ints("N", "K") | {"eps": "fp32"}
    norm = {"x_ptr": "*bf16", "stride_xm": "i32", "g_ptr": "*bf16", "y_ptr": "*bf16", "stride_ym": "i32", "K": "i32", "eps": "fp32"}
    silu = {"h_ptr": "*bf16", "stride_hm": "i32", "y_ptr": "*bf16", "stride_ym": "i32", "N": "i32"}
    embed = {"tokens_ptr": "*i64", "stride_tn": "i32", "table_ptr": "*bf16", "stride_v": "i32", "start_ptr": "*i64", "x_ptr": "*bf16",
             "pos_ptr": "*i64", "len_ptr": "*i64"} | ints("T", "H", "mask_id")
    return [
        (exact_ops._linear_kernel, linear, dict(GATED=True, BIAS=True, RESIDUAL=True, TAP=True, SCALED=False, SPLITS=2, FIXUP=True,
                                                TILES=2, TM=16, BN=64, BK=128, INTERP=False)),
        (exact_ops._linear_kernel, fp8_linear, dict(GATED=True, BIAS=True, RESIDUAL=True, TAP=True, SCALED=True, SPLITS=2, FIXUP=True,
                                                    TILES=2, TM=16, BN=64, BK=128, INTERP=False)),
        (exact_ops._split_sum_kernel, sums, dict(GATED=True, BIAS=True, RESIDUAL=True, TAP=True, SCALED=False, SPLITS=4, TM=16, BN=256)),
        (exact_ops._attention_kernel, exact, shape | dict(SPLIT=256, ROWS=True, COMBINE=False, INTERP=False)),
        (exact_ops._attention_kernel, exact, shape | dict(SPLIT=256, ROWS=True, COMBINE=True, INTERP=False)),
        (exact_ops._combine_kernel, combine, shape | dict(SPLIT=256)),
        (triton_ops._qk_rope_write_kernel, rope, dict(D=128, NORM=True, ROWS=True, LENGTHS=True)),
        (triton_ops._attention_kernel, fast, dict(D=128, BLOCK_Q=64, BLOCK_N=64, CAUSAL=True, WINDOW=True, SPLIT=True, ROWS=True)),
        (triton_ops._combine_kernel, fast_combine, dict(D=128, BLOCK_Q=64, SPLITS=5, SPLITS_P2=8, ROWS=16)),
        (triton_ops._gemv_kernel, gemv, dict(NORM=True, GATED=True, BIAS=True, RESIDUAL=True, TAP=True, EVEN_K=True, BN=16, BK=512,
                                             EARLY_SUM=False)),
        (triton_ops._rms_norm_kernel, norm, dict(BK=4096)),
        (triton_ops._silu_mul_kernel, silu, dict(BN=1024)),
        (triton_ops._embed_kernel, embed, dict(TOKENS=False, BH=1024)),
    ]


@needs_triton
def test_split_sum_and_attention_kernels_compile_for_sm90():
    """Bug: a kernel the tests only run interpreted no longer compiles for the GPU (the split-K sum pass; the fast
    and exact attention kernels, which share one query-tile setup; the in-kernel combine with its counter; the
    q/k-norm, RoPE and K/V write with its per-row write masks): the first CUDA call of the backend fails."""
    for kernel, args, constexprs in _launched_kernels():
        try:
            ir = _ttgir(kernel, args, set(), constexprs | {"PDL": False}, 4, 2)
        except ImportError as error:  # a Triton without the NVIDIA backend's compiler
            pytest.skip(f"cannot compile for sm90 here: {error!r}"[:200])
        assert "tt.func" in ir, kernel


@needs_triton
def test_exact_attention_compiles_to_one_arithmetic_at_every_pipeline_depth():
    """Bug: the exact attention's loads in flight (``attention_stages``, chosen per head shape and element size,
    said to move loads only) change its compiled arithmetic: another reduction layout or MMA at one depth, so
    a query's bits would follow the depth a head shape or dtype picks."""
    from dflash_trt.runtime.kernels import exact_ops

    attention = [(k, a, c) for k, a, c in _launched_kernels() if k is exact_ops._attention_kernel]
    assert len(attention) == 2  # the combine in a second launch, and in the kernel
    for kernel, args, constexprs in attention:
        try:
            by_depth = {stages: _arithmetic(_ttgir(kernel, args, set(), constexprs | {"PDL": False}, 4, stages)) for stages in (1, 2, 3, 4)}
        except ImportError as error:  # a Triton without the NVIDIA backend's compiler
            pytest.skip(f"cannot compile for sm90 here: {error!r}"[:200])
        reductions, mma = by_depth[2]
        assert reductions and mma, "no reduction or dot found in the attention's IR"
        assert all(found == by_depth[2] for found in by_depth.values()), {s: a for s, a in by_depth.items() if a != by_depth[2]}


def test_exact_attention_pipeline_depth_fits_shared_memory():
    """Bug: the attention's pipeline depth outgrows a program's shared memory for a wide head, an fp32 cache or
    a GPU with less of it per program (Triton then fails at the first launch), or stays at two steps where three
    fit (a query's few steps wait a memory round trip each)."""
    from dflash_trt.runtime.kernels.plan import exact_attention_stages

    for shared in (EXACT_SHARED_BYTES, SM89_SHARED_BYTES, 64 * 1024):  # an H200, an sm89 GPU (99 KiB a program), less
        for head_dim in (64, 80, 128, 256):
            for element_bytes in (2, 4):
                stages = exact_attention_stages(head_dim, element_bytes, shared=shared)
                step = 2 * exact_attention_block_n(head_dim) * head_dim * element_bytes
                budget = min(EXACT_STAGE_BYTES, shared)
                assert stages == max((d for d in (1, 2, 3) if d * step <= budget), default=1), (shared, head_dim, element_bytes, stages)
    assert exact_attention_stages(128, 2) == 3  # the Qwen3-8B shape in bf16 on an H200: 96 KiB of tiles
    assert exact_attention_stages(128, 2, shared=SM89_SHARED_BYTES) == 2  # on an sm89 GPU: 64 KiB


@needs_triton
def test_exact_attention_holds_three_programs_per_sm():
    """Bug: a change to the exact attention that keeps every bit raises its registers past what lets an H100 /
    H200 SM hold three of its programs (the fold's first eight splits loaded at once: 146 -> 203 registers under
    Triton 3.6), and a four-owner verify's attention runs 20% slower (39.3 -> 47.6 µs per layer at context 2048 on
    an H100: benchmarks/RESULTS.md, "The exact attention's fold with eight splits' loads at once"). Compiled for
    sm90 here (``benchmarks/kernel_resources.py``, the launch's alignment), at the Qwen3-8B head shape in bf16
    with the product's pipeline depth: three programs per SM by registers and by shared memory, no spills."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import kernel_resources  # benchmarks/kernel_resources.py
    from dflash_trt.runtime.kernels import exact_ops
    from dflash_trt.runtime.kernels.plan import exact_attention_stages

    stages = exact_attention_stages(128, 2)  # 3: an H100 / H200's budget
    try:
        found = kernel_resources.resources(exact_ops._attention_kernel, kernel_resources.SHAPE | {"COMBINE": True}, 4, stages)
    except (ImportError, FileNotFoundError) as error:  # a Triton without the NVIDIA backend's compiler or cuobjdump
        pytest.skip(f"cannot compile for sm90 here: {error!r}"[:200])
    assert found["by_registers"] >= 3 and found["by_shared"] >= 3, found
    assert found["stack_bytes"] == 0 and found["local_accesses"] == 0, found


def test_an_exact_kernels_run_records_each_section_it_ran(tmp_path):
    """Bug: ``benchmarks/exact_kernels.py`` appended only its graph rows to results.jsonl; a section measured on the
    device (the stages A/B, the graphs' kernel profile) reached it only when copied by hand from ``$OUT``, and a
    section that failed left no row at all. Run as ``main`` runs them (``gpu_graphs.Report``), one section
    measured and one failing: the rows are the graph rows, then each section's rows or its error, stamped alike."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import exact_kernels  # benchmarks/exact_kernels.py
    import gpu_graphs

    report = gpu_graphs.Report(tmp_path / "exact_kernels.json")
    report.data["graph_rows"] = [{"kernels": "exact", "owners": n, "ar_step_ms": 6.3} for n in (1, 4)]
    measured = [{"stages": "product", "tokens": 16, "owners": 4, "us_per_layer": 30.5, "same_bits": True}]
    report.section("stages_us", lambda: measured)

    def broken():
        raise RuntimeError("no CUDA device")

    report.section("profile_us", broken)
    stamp = {"date": "2026-12-07 07:00 UTC", "machine": "m", "command": "c", "pdl": True}
    rows = exact_kernels.result_rows(report.data, ["stages", "profile"], stamp)

    assert [r["name"] for r in rows] == ["exact_kernels", "exact_kernels", "exact_kernels_stages", "exact_kernels_profile"]
    assert all({k: r[k] for k in stamp} == stamp for r in rows)
    assert [r["owners"] for r in rows[:2]] == [1, 4]
    assert rows[2]["rows"] == measured
    assert rows[3]["failure"] == "RuntimeError: no CUDA device" and "rows" not in rows[3]


def test_a_crowded_exact_attention_launch_holds_four_programs_per_sm():
    """Bug: a launch of more exact attention programs than three per SM (a four-owner verify at context 2048: 1,024
    live programs on 132 SMs) waits on latency with three warps per scheduler (benchmarks/RESULTS.md, "The exact
    attention: split windows ..."); capped at 128 registers and two steps in flight it holds four, and the cap must
    neither leave four out of reach nor spill more than a few values (none under Triton 3.6, the CUDA builds' own;
    15 local loads and stores under 3.9). Also the rule: only a crowded launch is capped, an explicit depth of one
    step is kept."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import kernel_resources  # benchmarks/kernel_resources.py
    from dflash_trt.runtime.kernels import exact_ops
    from dflash_trt.runtime.kernels.plan import (
        EXACT_ATTENTION_PROGRAMS,
        exact_attention_launch,
    )

    assert exact_attention_launch(8 * 16, 132, 3) == (3, None)  # the AR step at max_context 4096: 8 units x 16 splits
    assert exact_attention_launch(EXACT_ATTENTION_PROGRAMS * 132, 132, 3) == (3, None)
    assert exact_attention_launch(EXACT_ATTENTION_PROGRAMS * 132 + 1, 132, 3) == (2, 128)
    assert exact_attention_launch(128 * 16, 132, 2) == (2, 128) and exact_attention_launch(128 * 16, 132, 1) == (1, None)
    stages, registers = exact_attention_launch(128 * 16, 132, 3)
    try:
        found = kernel_resources.resources(exact_ops._attention_kernel, kernel_resources.SHAPE | {"COMBINE": True}, 4, stages, registers)
    except (ImportError, FileNotFoundError) as error:  # a Triton without the NVIDIA backend's compiler or cuobjdump
        pytest.skip(f"cannot compile for sm90 here: {error!r}"[:200])
    assert found["by_registers"] >= 4 and found["by_shared"] >= 4, found
    assert found["local_accesses"] <= 32, found


def test_exact_linear_pipelines_fit_a_gpus_shared_memory():
    """Bug: the exact linear's pipelines are sized for an H100's shared memory on every GPU: on an sm86 / sm89
    GPU (99 KiB a program) the Qwen3-8B and default-pair weights ask 128-160 KiB and their first launch fails;
    or fitting them changes what a row sums (the K step) or, on an H100 / H200, any launch at all."""
    tiny = {"q|k|v": (448, 320, False), "o": (320, 320, False), "gate|up": (896, 320, True), "down": (320, 896, False), "head": (8192, 320, False)}
    for processors in (132, 128, 84):
        for N, K, gated in [*(w[:3] for w in WEIGHTS_8B.values()), *tiny.values()]:
            for element_bytes in (2, 4):
                plan = exact_linear_plan(N, K, gated, element_bytes, processors)
                for M in ROW_COUNTS:
                    wide = exact_linear_launch(plan, M, gated, element_bytes, N, processors, 1 << 30)  # no bound: the spread before
                    wide_step = _step_bytes(plan, wide[0], wide[1], gated, element_bytes)
                    assert element_bytes == 4 or 2 * wide_step <= EXACT_SHARED_BYTES  # bf16 on an H100 / H200: nothing changes
                    if 2 * wide_step <= EXACT_SHARED_BYTES:
                        assert exact_linear_launch(plan, M, gated, element_bytes, N, processors) == wide
                    for shared in (SM89_SHARED_BYTES, 48 * 1024):
                        tiles, block_n, stages = exact_linear_launch(plan, M, gated, element_bytes, N, processors, shared)
                        step = _step_bytes(plan, tiles, block_n, gated, element_bytes)
                        assert 2 <= stages <= 4 and stages * step <= max(2 * step, min(EXACT_STAGE_BYTES, shared))
                        assert 2 * step <= shared or (tiles, block_n) == (1, 16), (N, K, M, shared, tiles, block_n)
                        assert tiles <= wide[0] and block_n <= wide[1] and block_n >= 16
    # The 8B gate|up at 64 rows on an sm89 GPU: four tiles of 64 features in 3 stages (144 KiB) become two tiles, 2 stages.
    plan = exact_linear_plan(12288, 4096, True, 2, 128)
    assert exact_linear_launch(plan, 64, True, 2, 12288, 128) == (4, 64, 3)
    assert exact_linear_launch(plan, 64, True, 2, 12288, 128, SM89_SHARED_BYTES) == (2, 64, 2)


def test_exact_pipelines_follow_the_gpus_shared_memory(monkeypatch):
    """Bug: the pipelines are sized from a constant whatever the GPU: on an sm86 / sm89 GPU (99 KiB a program)
    three attention steps of a 128-wide bf16 head, or the linear's H100 pipelines, do not fit and the first
    launch fails."""
    from dflash_trt.runtime.kernels import exact_ops
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import exact_attention_stages

    limits = {0: 232448, 1: 101376}  # an H200's and an RTX 4090's per-program limits (Triton's max_shared_mem)
    monkeypatch.setattr(exact_ops, "max_shared_mem", limits.__getitem__)
    ops = ExactOps()
    shared = {i: ops.shared_bytes(torch.device("cuda", i)) for i in limits}
    assert shared == {0: EXACT_SHARED_BYTES, 1: 101376 - EXACT_SHARED_HEADROOM}
    assert [exact_attention_stages(128, 2, shared=shared[i]) for i in (0, 1)] == [3, 2]
    assert ops.shared_bytes(torch.device("cpu")) == EXACT_SHARED_BYTES


@needs_triton
def test_a_kernel_launched_overlapping_waits_for_its_predecessor_before_any_memory_access():
    """Bug: a kernel launched with programmatic dependent launch (``launch_pdl``: it may start while the launch
    before it still runs) loads its inputs, or stores over a buffer its predecessor still reads, before
    ``griddepcontrol.wait``: it reads stale activations or the previous layer's half-written outputs, a race no
    CPU test sees. Every launched kernel, compiled for sm90 with PDL, must wait before its first global load,
    store or atomic, and compute exactly what it computes without PDL (the same reductions and MMAs)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_trt.runtime.kernels import triton_ops

    if triton_ops.gdc_wait is None:
        pytest.skip("this Triton has no grid dependency control")
    memory = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|atom\.|red\.|cp\.async)")
    for kernel, args, constexprs in _launched_kernels():
        compiled = {}
        for mode in (False, True):
            source = ASTSource(fn=kernel, signature=args | {k: "constexpr" for k in constexprs | {"PDL": mode}},
                               constexprs=constexprs | {"PDL": mode})
            try:
                compiled[mode] = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
            except ImportError as error:  # a Triton without the NVIDIA backend's compiler
                pytest.skip(f"cannot compile for sm90 here: {error!r}"[:200])
        name = kernel.fn.__name__
        assert _arithmetic(compiled[True].asm["ttgir"]) == _arithmetic(compiled[False].asm["ttgir"]), name
        assert not any("griddepcontrol" in line for line in compiled[False].asm["ptx"].splitlines()), name
        ptx = compiled[True].asm["ptx"].splitlines()
        waits = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
        first_access = next(i for i, line in enumerate(ptx) if memory.match(line))
        assert waits and waits[0] < first_access, (name, waits, ptx[first_access])
        assert any("griddepcontrol.launch_dependents" in line for line in ptx), name  # else no overlap


# ------------------------------------------------------------------ the kernels, interpreted (CPU)

CHECKS = ("linear_rows", "split_rows", "wide_rows", "fp8_linear", "attention_rows", "attention_rows_split", "rope_rows", "linear_reference",
          "attention_reference", "exact_target")
# The (check, dtype) pairs in two processes of about equal time (one core each; on a 2-core box ~88 and ~94 s of a
# core; one process per dtype had bf16's take ~1.5x fp32's while the other core idled).
PROCESSES = (
    [(name, "bfloat16") for name in ("linear_rows", "wide_rows", "attention_rows", "attention_rows_split", "rope_rows", "linear_reference",
                                     "attention_reference")],
    [(name, "float32") for name in CHECKS] + [(name, "bfloat16") for name in ("split_rows", "fp8_linear", "exact_target")],
)
INTERPRETED = """
import json, sys, traceback
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import exact_checks
results = {{}}
for name, dtype_name in {jobs!r}:
    check, dtype = getattr(exact_checks, "check_" + name), getattr(torch, dtype_name)
    args = ("cpu", dtype, True) if name in ("linear_rows", "attention_rows") else ("cpu", dtype)
    try:
        check(*args)
        results[f"{{name}} {{dtype}}"] = "ok"
    except Exception:
        results[f"{{name}} {{dtype}}"] = traceback.format_exc()[-3000:]
print("RESULTS " + json.dumps(results))
"""


def interpreted_scripts() -> list[str]:
    """The interpreted checks' scripts (``PROCESSES``), none without Triton (conftest starts them at collection)."""
    tests = str(Path(__file__).parents[1])
    return [INTERPRETED.format(tests=tests, jobs=jobs) for jobs in PROCESSES] if TRITON else []


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every kernel check of exact_checks, fp32 and bf16, under Triton's interpreter: two processes at once
    (``PROCESSES``; one thread each: the two cores of a CI box; 45 s to 5 min each, by how fast the box is),
    started in the background as the run was collected (tests/interpreted.py)."""
    if not TRITON:
        pytest.skip("needs triton (it ships with the CUDA builds of torch)")
    return interpreted_results(__name__, interpreted_scripts())


def _passed(results: dict[str, str], name: str) -> None:
    failed = {key: value for key, value in results.items() if key.startswith(name + " ") and value != "ok"}
    assert not failed, "\n\n".join(f"{key}:\n{value}" for key, value in failed.items())
    assert sum(key.startswith(name + " ") for key in results) == 2, results.keys()  # fp32 and bf16 both ran


def test_exact_linear_rows_do_not_depend_on_the_batch(interpreted):
    """Bug: a row's linear output (every epilogue: RMSNorm, bias, SiLU·mul, residual in place, tap, fp32 LM-head
    logits) changes with the row count (1 / 5 / 16 / 64 of 70) or its place among the rows: a DFlash verify row
    and the same token decoded alone then differ in bf16 and near-ties flip."""
    _passed(interpreted, "linear_rows")


def test_exact_split_k_rows_do_not_depend_on_the_batch(interpreted):
    """Bug: with K split in several ranges (per weight), a row's output depends on the row count or the launch it
    lands in (the splits' partial sums added in another order, a workspace row read by another launch), or the
    split sums compute something else than the
    product: M = 1 / 16 / 64 of 70 rows across 64-row launches, three tilings, every epilogue, against fp32."""
    _passed(interpreted, "split_rows")


def test_exact_wide_tiles_give_the_16_row_tiles_bits(interpreted):
    """Bug: computing four 16-row tiles as one 64-row tile (``wide_tiles``: the warp-group MMA on sm90) changes a
    row's bits or drops rows: its grid, split-K workspace rows or in-kernel sums' counters counted in 16-row tiles,
    a partial 64-row tile's masks; one split and split-K, every epilogue, 70 rows against the 16-row tiles' launch."""
    _passed(interpreted, "wide_rows")


def test_exact_fp8_linear_rows_do_not_depend_on_the_batch(interpreted):
    """Bug: an fp8 weight (the draft's ``draft_weights="fp8"``) through the exact linear computes something else than
    x @ (q * scale).T (the scale missed, applied per row instead of per feature, or to one half of gate|up; the
    result rounded to fp8), or a row's output depends on the row count or the split-K launch it lands in."""
    _passed(interpreted, "fp8_linear")


def test_the_exact_target_computes_the_twins_forward(interpreted):
    """Bug: the exact kernels, each right alone, do not compose into the target's forward (the attention reading
    the caches the rope kernel wrote at other strides, a norm or tap epilogue in the wrong place, the head's
    final norm): features, taps or logits leave the twin's (tested op by op only, such a bug shows first on a GPU)."""
    _passed(interpreted, "exact_target")


def test_exact_attention_does_not_depend_on_queries_owners_or_capacity(interpreted):
    """Bug: a query's attention changes with the queries per owner (1 vs 16), the owners in the launch (1 vs 3),
    the cache capacity (520 vs 820 slots) or pools addressed by rows: causal, windowed and non-causal layers."""
    _passed(interpreted, "attention_rows")


def test_exact_rope_write_rows_do_not_depend_on_the_batch(interpreted):
    """Bug: q/k-norm + RoPE + the K/V write of a row differ when it is written alone or among 16 per owner
    (the cache a later decode step reads would hold other bits than a verify wrote)."""
    _passed(interpreted, "rope_rows")


def test_exact_ops_agree_with_the_reference(interpreted):
    """Bug: the exact kernels compute something else than the reference layers (RMSNorm -> Linear, SwiGLU,
    residual; softmax attention with causal / window / non-causal masks) beyond bf16 rounding; a fold of many
    splits (ten at 64-slot splits: three rounds of its loads) leaves out or misweighs some of them."""
    _passed(interpreted, "linear_reference")
    _passed(interpreted, "attention_reference")


# ------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("check", ["linear_rows", "split_rows", "wide_rows", "fp8_linear", "attention_rows", "rope_rows"])
def test_exact_kernels_are_batch_invariant_on_cuda(check, dtype):
    """Bug: compiled for the GPU, a row's result depends on the batch after all (tensor-core tiles that round
    a row by its place in the tile, a kernel specialized on the row count, a split chosen from the key count):
    Qwen3-8B weight shapes, M = 1 .. 300 rows, 1 / 16 queries, 1 / 3 owners, two capacities, bit for bit."""
    import exact_checks

    if check in ("rope_rows", "split_rows", "wide_rows", "fp8_linear"):
        getattr(exact_checks, f"check_{check}")("cuda", dtype)
    else:
        getattr(exact_checks, f"check_{check}")("cuda", dtype, small=False)


@gpu
def test_the_gpus_shared_memory_is_read_and_the_default_pipelines_fit_it():
    """Bug: the per-program shared-memory query fails or reads a wrong limit on a real GPU (every exact launch
    sizes its pipeline from it), or the Qwen3-8B shape's pipelines ask more than this GPU's programs hold."""
    from dflash_trt.runtime.kernels import exact_ops
    from dflash_trt.runtime.kernels.plan import exact_attention_stages

    device = torch.device("cuda")
    limit = exact_ops.max_shared_mem(torch.cuda.current_device())
    assert 48 * 1024 <= limit <= 1024 * 1024, limit  # every CUDA GPU Triton supports: 48 KiB to 227 KiB a program
    ops = exact_ops.ExactOps()
    shared = ops.shared_bytes(device)
    assert shared == limit - EXACT_SHARED_HEADROOM
    processors = ops.processors(device)
    for N, K, gated, _ in WEIGHTS_8B.values():
        plan = exact_linear_plan(N, K, gated, 2, processors)
        for M in ROW_COUNTS:
            tiles, block_n, stages = exact_linear_launch(plan, M, gated, 2, N, processors, shared)
            assert stages * _step_bytes(plan, tiles, block_n, gated, 2) <= limit, (N, K, M)
    assert exact_attention_stages(128, 2, shared=shared) * 2 * exact_attention_block_n(128) * 128 * 2 <= limit


@gpu
def test_a_crowded_exact_attention_launch_gives_each_query_its_lone_bits_on_cuda():
    """Bug: the register cap and shallower pipeline of a crowded launch (``plan.exact_attention_launch``) change what
    a query sums (the compiler reorders or contracts its arithmetic under register pressure), so a verify of four
    owners gives other bits than each position decoded alone, and bf16 DFlash drifts from plain decoding at
    exactly the owner counts where it runs. Qwen3-8B heads (32 / 8 x 128), a 4,096-slot cache, contexts from 1,000
    to 3,100: four owners x 16 queries (2,048 programs on the grid: capped) against each query alone (128: not)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import exact_attention_launch

    ops, device, generator = ExactOps(), torch.device("cuda"), torch.Generator(device="cuda").manual_seed(21)
    n, T, L = 4, 16, 4096
    assert exact_attention_launch(n * 8 * 4 * 16, ops.processors(device), 3)[1] is not None  # the crowded launch is capped here
    k, v = (torch.randn(n, 8, L, 128, device=device, generator=generator).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n, 32, T, 128, device=device, generator=generator).to(torch.bfloat16)
    start = torch.tensor([1000, 1777, 2048, 3100], device=device)
    positions, kv_len = start[:, None] + torch.arange(T, device=device), start + T
    crowded = ops.attention(q, k, v, None, positions, kv_len, True, 0)
    for i in range(n):
        for t in (0, 7, T - 1):
            alone = ops.attention(q[i : i + 1, :, t : t + 1].contiguous(), k[i : i + 1], v[i : i + 1], None, positions[i : i + 1, t : t + 1],
                                  start[i : i + 1] + t + 1, True, 0)
            assert torch.equal(alone[0, :, 0].view(torch.int16), crowded[i, :, t].view(torch.int16)), (i, t)


ATTENTION_TILES = [{"block_q": 32}, {"block_q": 64}, {"split_slots": 128}, {"split_slots": 128, "block_n": 128}, {"split_slots": 64}]


@gpu
@pytest.mark.parametrize("tile", [{}, *ATTENTION_TILES], ids=lambda tile: "-".join(f"{k}{v}" for k, v in tile.items()) or "default")
def test_exact_attention_is_batch_invariant_at_every_tile_on_cuda(tile):
    """Bug: at a tile other than the default (height, split window, inner step) the rows of a tile share more
    than the key loads (a row's softmax or its split fold taking another row's range or scale), so the tile
    chosen for speed breaks the invariance: bf16, 1 / 16 queries, 1 / 3 owners, two capacities, every layer
    kind, bit for bit."""
    import exact_checks

    exact_checks.check_attention_rows("cuda", torch.bfloat16, small=False, **tile)


def test_exact_attention_at_another_split_is_batch_invariant(interpreted):
    """Bug: a split window or inner step other than the default (64 slots in two 32-slot steps) makes a query's
    result follow the queries, owners or capacity of its launch (the combine folding another split range, a
    step that starts at a relative slot), both fold paths alike, also for a unit of nine splits (three rounds
    of the fold's loads)."""
    _passed(interpreted, "attention_rows_split")


@needs_triton
def test_exact_attention_tile_is_checked():
    """Bug: a tile Triton cannot tile (a height or step not a power of two, below the MMA's 16 rows), a
    split window that is no whole number of steps or a warp count Triton cannot lay out fails inside the
    compiler at the first launch instead of naming the field."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    for bad in (0, 8, 48):
        with pytest.raises(ValueError, match=f"block_q must be a power of two >= 16, got {bad}"):
            ExactOps(block_q=bad)
        with pytest.raises(ValueError, match=f"block_n must be a power of two >= 16, got {bad}"):
            ExactOps(block_n=bad)
    for slots in (32, 96):
        with pytest.raises(ValueError, match=f"split_slots must be a positive multiple of block_n \\(64\\), got {slots}"):
            ExactOps(split_slots=slots, block_n=64)
    for warps in (0, 3, 16):
        with pytest.raises(ValueError, match=f"attention_warps must be 1, 2, 4 or 8, got {warps}"):
            ExactOps(attention_warps=warps)
    for stages in (0, 7):
        with pytest.raises(ValueError, match=f"attention_stages must be in \\[1, 6\\], got {stages}"):
            ExactOps(attention_stages=stages)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_kernels_agree_with_the_reference_on_cuda(dtype):
    """Bug: the compiled exact kernels compute something else than the reference layers on the GPU."""
    import exact_checks

    exact_checks.check_linear_reference("cuda", dtype)
    exact_checks.check_attention_reference("cuda", dtype)


def _bf16_backend(target_dir, draft_dir, sessions: int, max_context: int, max_chunk: int, kernels="exact", draft_weights="model"):
    """The pair in bf16 on CUDA with ``kernels`` (exact), ``sessions`` cache rows, up to ``sessions`` owners per launch."""
    from dflash_trt.export.exporter import ExportOptions, contract_dims
    from dflash_trt.export.pair import load_pair
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    target, draft = load_pair(target_dir, draft_dir, dtype=torch.bfloat16)
    options = ExportOptions(max_owners=sessions, max_context=max_context, max_chunk=max_chunk, proposals=draft.config.block_size - 1, dtype="bf16")
    return TorchBackend(target, draft, contract_dims(target, draft, options), sessions, device="cuda", kernels=kernels,
                        draft_weights=draft_weights)


def _assert_identical(outputs: dict, requests, what: str) -> None:
    import exact_checks

    for i, (plain, dflash) in enumerate(zip(outputs["plain"], outputs["dflash"])):
        label = f"{what}, request {i} (T={requests[i].sampling.temperature})"
        assert plain == dflash, f"{label}: DFlash left plain decoding at {exact_checks.first_difference(plain, dflash)}"


@gpu
@pytest.mark.parametrize("sessions", [1, 4])
def test_dflash_equals_plain_decoding_in_bf16_on_the_tiny_pair(exported_pair, sessions):
    """Bug: with kernels="exact", bf16 DFlash (16-row verify launches, owners packed together) emits another
    token than plain decoding of the same prompt (1-row decode steps) — the target's own greedy output."""
    import exact_checks

    from dflash_trt.runtime.serving.batcher import Request

    requests = [Request(prompt, 20) for prompt in exported_pair.prompts]
    with _bf16_backend(exported_pair.target_dir, exported_pair.draft_dir, sessions, 64, 16) as backend:
        outputs = exact_checks.serve_both(backend, requests, sessions)
    _assert_identical(outputs, requests, f"tiny pair, {sessions} sessions")


@gpu
def test_overlapped_launches_give_the_tokens_of_plain_launches():
    """Bug: with programmatic dependent launch (a kernel's start overlapping the end of the launch before it) some
    kernel touches memory before ``griddepcontrol.wait`` — reading activations its predecessor has not written yet,
    or overwriting a buffer its predecessor still reads — or a captured graph loses a dependency: tokens change, or
    change from run to run. The default pair in bf16 at 16 sessions, DFlash and plain decoding, greedy and sampled:
    the exact kernels launched overlapping give every token of the same kernels launched plainly."""
    import exact_checks

    from dflash_trt.export.pair import DEFAULT_PAIR_DIR
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.triton_ops import pdl_capable

    if not pdl_capable(torch.device("cuda")):
        pytest.skip("needs an sm90+ GPU and a Triton with launch_pdl")
    requests = exact_checks.default_pair_requests(16, 64)
    outputs = {}
    for pdl in (False, True):
        with _bf16_backend(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", 16, 1024, 256, ExactOps(pdl=pdl)) as backend:
            outputs[pdl] = exact_checks.serve_both(backend, requests, 16)
    for mode in ("plain", "dflash"):
        for i, (plain, overlapped) in enumerate(zip(outputs[False][mode], outputs[True][mode])):
            assert plain == overlapped, f"{mode}, request {i}: overlapped launches differ at {exact_checks.first_difference(plain, overlapped)}"


@gpu
def test_dflash_equals_plain_decoding_in_bf16_on_the_default_pair():
    """Bug: on the shipped pair in bf16 (kernels="exact"), DFlash's output differs from plain decoding's for some
    request, greedy or sampled (same seeds), at 1, 4 or 16 concurrent sessions; or a request's output changes
    with how many others share its launches (1 vs 4 vs 16 sessions, greedy and sampled requests mixed)."""
    import exact_checks

    from dflash_trt.export.pair import DEFAULT_PAIR_DIR

    requests = exact_checks.default_pair_requests(16, 96)
    alone = None
    for sessions in (1, 4, 16):
        with _bf16_backend(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", sessions, 1024, 256) as backend:
            outputs = exact_checks.serve_both(backend, requests, sessions)
        _assert_identical(outputs, requests, f"default pair, {sessions} sessions")
        alone = alone or outputs["plain"]
        for i, (one, shared) in enumerate(zip(alone, outputs["plain"])):
            assert one == shared, f"request {i}: 1 vs {sessions} sessions differ at {exact_checks.first_difference(one, shared)}"


@gpu
def test_an_fp8_draft_keeps_bf16_dflash_equal_to_plain_decoding():
    """Bug: with the draft's weights in fp8 (``draft_weights="fp8"``, compiled fp8 products on the GPU) DFlash's
    output leaves plain decoding's (greedy or sampled, 4 sessions, the shipped pair in bf16, exact kernels), or
    the compiled fp8 products break the draft (its acceptance collapses: fewer than 2 tokens per cycle)."""
    import exact_checks

    from dflash_trt.export.pair import DEFAULT_PAIR_DIR
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.generate import collect, stream

    requests = exact_checks.default_pair_requests(8, 64)
    with _bf16_backend(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", 4, 1024, 256, draft_weights="fp8") as backend:
        outputs = exact_checks.serve_both(backend, requests, 4)
        with Executor(backend, max_sessions=4, policy="always") as executor:
            collect(stream(executor, requests[:8], 4), 8)  # the greedy half
            cycles = executor.cycle_stats()
    _assert_identical(outputs, requests, "default pair, fp8 draft, 4 sessions")
    tau = (cycles["accepted"].sum() + len(cycles)) / len(cycles)
    assert tau >= 2.0, tau


@gpu
def test_a_request_beside_63_others_equals_it_alone_in_bf16():
    """Bug: in bf16 (kernels="exact") a request served by the serving loop beside 63 others with DFlash
    (64 owners per launch, cycles and joining prompts mixed) emits other tokens than the same request
    decoded plainly and alone — greedy or top-p sampled with the same seed."""
    import exact_checks

    from dflash_trt.export.pair import DEFAULT_PAIR_DIR
    from dflash_trt.export.tokenizer import Tokenizer
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.serving.loop import ServingLoop

    tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    rows = [json.loads(line) for line in (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [tokenizer.encode(row["prompt"])[-160:] for row in rows[:64]]
    samplings = [dict(temperature=0.0, seed=i) if i % 2 else dict(temperature=0.8, top_p=0.95, seed=100 + i) for i in range(len(prompts))]

    def serve(backend, speculate: bool, running: int) -> list[list[int]]:
        with Executor(backend, max_sessions=len(prompts), speculate=speculate) as executor:
            with ServingLoop(executor, stop_ids=tokenizer.stop_ids, max_running=running) as loop:
                handles = [loop.submit(p, 64, **s) for p, s in zip(prompts, samplings)]
                return [h.result(timeout=600).tokens for h in handles]

    with _bf16_backend(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", len(prompts), 1024, 256) as backend:
        alone = serve(backend, speculate=False, running=1)
        together = serve(backend, speculate=True, running=len(prompts))
    assert len(prompts) == 64
    for i, (one, shared) in enumerate(zip(alone, together)):
        assert one == shared, f"request {i} {samplings[i]}: alone (plain) vs 64 streams (DFlash) differ at {exact_checks.first_difference(one, shared)}"
