"""The tile sweep of the exact linear (``benchmarks/exact_kernels.py --sweep``): one tiling per 8B weight.

A tiling (``plan.ExactLinearPlan``) has an arithmetic part, fixed per weight (K step, warps, split count:
how a row is summed) and a spread part (features per program at M <= 8 and above, the in-kernel ordered
sum: how work is distributed). Two phases, each compiled first in parallel worker processes that share
Triton's disk cache:

1. M = 1: every arithmetic part (K step 64 / 128 / 256 x splits 1 / 2 / 4 / 8, each split >= 4 steps) with
   each one-row feature block, timed over the 36 layers' own weights in one CUDA graph;
2. the best arithmetic parts (two, the best one with 8 warps too, and the default rule's), with and
   without the in-kernel sum (``fixup``) when split: the many-row feature block at M = 16, that block and the
   tiles per program (1 / 2 / 4) at M = 64.

Every phase-2 candidate is checked before it may win: the rows of M = 1 (three single rows), M = 16 and a
shuffled M = 64 are bit-identical to the same rows of one M = 64 launch (twice, for a race), and the M = 64
output is within bf16 rounding of an fp32 brute-force reference. A failing candidate (compile error,
mismatch) is recorded and skipped; the winner minimizes t(M=1) + t(M=16) + t(M=64). Past ``budget_s`` the
sweep stops and keeps what it measured (the default rule for the rest).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import gpu_graphs as gg

ROWS = (1, 16, 64)
ORDER = ("gate_up", "down", "qkv", "o", "lm_head")  # by their share of the decode step: a cut budget hits the last
DEVICE = "cuda"  # "cpu" under Triton's interpreter: a dry run of the sweep's code (tiny shapes, no timing)


def phase1_plans(N: int, K: int, gated: bool) -> list:
    """Every arithmetic part x one-row feature block of a weight (4 warps, the stage rule, no fixup)."""
    from dflash_trt.runtime.kernels.plan import ExactLinearPlan as P

    wide = N >= 65536
    block_ns = (32, 64, 128) if wide else (16, 32) if gated else (16, 32, 64)
    plans = []
    for block_k in (64, 128, 256):
        for splits in (1, 2) if wide else (1, 2, 4, 8):
            if splits > 1 and K // (splits * block_k) < 4:
                continue
            plans += [P(block_n, 64, block_k, 4, splits) for block_n in block_ns]
    return plans


def row_blocks(N: int, gated: bool) -> tuple[int, ...]:
    """Many-row feature blocks tried in phase 2."""
    return (128, 256) if N >= 65536 else (32, 64) if gated else (64, 128)


def arithmetic(plan) -> tuple:
    return plan.block_k, plan.warps, plan.splits, plan.stages


# ---------------------------------------------------------------------- compile (workers)


def _compile_job(job) -> str:
    """Worker process: one launch on zeros so Triton compiles (name, plan) at M rows into the disk cache."""
    import torch

    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import ExactLinearPlan

    name, fields, M = job
    try:

        N, K, gated, *_ = gg.GEMMS[name]
        ops = ExactOps(linear_plans={(N, K, gated): ExactLinearPlan(*fields)})
        weight = torch.zeros((2 * N if gated else N), K, dtype=torch.bfloat16, device=DEVICE)
        x, norm = torch.zeros(M, K, dtype=torch.bfloat16, device=DEVICE), torch.ones(K, dtype=torch.bfloat16, device=DEVICE)
        gg._gemm_call(ops, name, x, weight, norm, torch.zeros(M, N, dtype=torch.bfloat16, device=DEVICE))
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 - recorded; the candidate is skipped later
        return f"{name} {fields} M={M}: {error!r}"[:400]


def compile_all(jobs: list) -> tuple[float, list[str]]:
    import multiprocessing
    import os

    began = time.perf_counter()
    workers = max(1, min(14, (os.cpu_count() or 2) - 2))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_job, [(n, p.fields(), m) for n, p, m in jobs], chunksize=1) if e]
    return time.perf_counter() - began, errors


# ---------------------------------------------------------------------- measure and check


class Bench:
    """Inputs per weight and the timing / checking of one (weight, plan)."""

    def __init__(self, target, reps: int) -> None:
        import torch

        self.weights, self.reps = weights_of(target), reps
        self.stream = torch.cuda.Stream() if DEVICE == "cuda" else None
        self.inputs = {}
        for name, (N, K, gated, *_) in gg.GEMMS.items():
            generator = torch.Generator(device=DEVICE).manual_seed(N + K)
            x = torch.randn(max(ROWS), K, device=DEVICE, generator=generator).to(torch.bfloat16)
            norm = (torch.randn(K, device=DEVICE, generator=generator) * 0.1 + 1).to(torch.bfloat16)
            self.inputs[name] = (x, norm, torch.randn(max(ROWS), N, device=DEVICE, generator=generator).to(torch.bfloat16))
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # the inputs, made on the default stream, before the sweep's stream reads them

    def ops(self, name: str, plan):
        from dflash_trt.runtime.kernels.exact_ops import ExactOps

        N, K, gated, *_ = gg.GEMMS[name]
        return ExactOps(linear_plans={(N, K, gated): plan})

    def time(self, name: str, plan, M: int) -> float:
        """µs per call over the weight's 36 layers (CUDA graph, median of reps)."""
        ops, (x, norm, residual) = self.ops(name, plan), self.inputs[name]
        xs, rs = x[:M], residual[:M].clone()
        calls = lambda: [gg._gemm_call(ops, name, xs, w, norm, rs) for w in self.weights[name]]  # noqa: E731
        return gg.graph_time(self.stream, calls, self.reps) / len(self.weights[name]) * 1e3

    def check(self, name: str, plan) -> str:
        """"" when the rows of M = 1 / 16 / shuffled 64 equal one M = 64 launch's (bits, twice) and M = 64 is within
        bf16 rounding of fp32; else what differs."""
        import torch

        ops, (x, norm, residual) = self.ops(name, plan), self.inputs[name]
        weight = self.weights[name][0]
        call = lambda rows: gg._gemm_call(ops, name, x[rows], weight, norm, residual[rows].clone())  # noqa: E731
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            everything = torch.arange(max(ROWS), device=DEVICE)
            full = call(everything)
            shuffled = torch.randperm(max(ROWS), device=DEVICE)
            parts = [(torch.tensor([r], device=DEVICE), f"M=1 row {r}") for r in (0, 17, 63)]
            parts += [(everything[5:21], "M=16 rows 5..20"), (shuffled, "M=64 shuffled")] * 2
            for rows, what in parts:
                if not torch.equal(call(rows).view(torch.int16 if full.dtype == torch.bfloat16 else torch.int32),
                                   full[rows].view(torch.int16 if full.dtype == torch.bfloat16 else torch.int32)):
                    return f"{what} differs from M=64"
            error = _relative_error(name, full, x, weight, norm, residual)
        return "" if error < 2e-2 else f"relative error {error:.2e} vs fp32"


def _relative_error(name: str, got, x, weight, norm, residual) -> float:
    """‖got - ref‖ / ‖ref‖ against the fp32 formula of gg._gemm_call's options."""
    import torch
    import torch.nn.functional as F

    N, _, gated, normed, has_residual, _ = gg.GEMMS[name]
    h = x.float()
    if normed:
        h = (norm.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float())
    y = h @ weight.float().T
    if gated:
        y = F.silu(y[:, :N]) * y[:, N:]
    if has_residual:
        y = y + residual.float()
    return float((got.float() - y).norm() / y.norm())


def weights_of(target) -> dict:
    """Each GEMM's weights of the 8B step: the 36 layers' own (no L2 reuse), the LM head 4 times."""
    layers = target.stack.layers
    return {"qkv": [L.qkv for L in layers], "o": [L.o for L in layers], "gate_up": [L.gate_up for L in layers],
            "down": [L.down for L in layers], "lm_head": [target.lm_head] * 4}


# ---------------------------------------------------------------------- the sweep


def sweep(target, reps: int, budget_s: float = 240.0) -> tuple[list[dict], dict, dict]:
    """(rows, best plan per (N, K, gated), errors): see the module docstring."""
    from dflash_trt.runtime.kernels.plan import exact_linear_plan

    began, bench, rows, best, errors = time.perf_counter(), Bench(target, reps), [], {}, {}
    left = lambda: budget_s - (time.perf_counter() - began)  # noqa: E731
    jobs = [(name, plan, 1) for name in ORDER for plan in phase1_plans(*_shape(name))]
    seconds, failed = compile_all(jobs)
    print(f"sweep phase 1: {len(jobs)} kernels compiled in {seconds:.0f} s ({len(failed)} failed)", flush=True)
    errors["compile_1"] = failed
    one = {}  # name -> [(us, plan)] at M = 1
    for name, plan, _ in jobs:
        if left() < 0:
            break
        us = _measure(bench, name, plan, 1, rows, errors)
        if us is not None:
            one.setdefault(name, []).append((us, plan))
    finalists = {}
    for name in ORDER:
        N, K, gated = _shape(name)
        by_arith = {}
        for us, plan in sorted(one.get(name, []), key=lambda item: item[0]):
            by_arith.setdefault(arithmetic(plan), (us, plan))
        top = [plan for _, plan in sorted(by_arith.values(), key=lambda item: item[0])[:2]]
        if top:
            top.append(replace(top[0], warps=8))
        top.append(exact_linear_plan(N, K, gated, 2))
        finalists[name] = list(dict.fromkeys(top))
        if one.get(name):
            us, plan = min(one[name], key=lambda item: item[0])
            print(f"  {name:8s} M=1 best {plan.fields()} {us:.1f} us", flush=True)
    jobs = phase2_jobs(finalists)
    if left() > 30:
        seconds, failed = compile_all(jobs)
        print(f"sweep phase 2: {len(jobs)} kernels compiled in {seconds:.0f} s ({len(failed)} failed)", flush=True)
        errors["compile_2"] = failed
    for name, plans in finalists.items():
        best_plan = _phase2(bench, name, plans, rows, errors, left)
        if best_plan is not None:
            best[_shape(name)] = best_plan
    return rows, best, errors


def _shape(name: str) -> tuple[int, int, bool]:
    """(N, K, gated) of one GEMM of the 8B step."""
    N, K, gated, *_ = gg.GEMMS[name]
    return N, K, gated


def phase2_jobs(finalists: dict) -> list:
    """(name, plan, M) of every kernel phase 2 may launch: each finalist at M = 1, with each many-row feature
    block at M = 16 and, with 1, 2 or 4 tiles per program, at M = 64; the same with the in-kernel sum when split."""
    jobs = []
    for name, plans in finalists.items():
        for plan in plans:
            for fixup in (False, True) if plan.splits > 1 else (False,):
                jobs += [(name, variant, m) for variant, m in _variants(name, replace(plan, fixup=fixup))]
    return jobs


def _variants(name: str, plan) -> list:
    """(plan, M) of one finalist: M = 1 as it is; M = 16 per many-row block; M = 64 per (block, tiles)."""
    N, gated = gg.GEMMS[name][0], gg.GEMMS[name][2]
    out = [(plan, 1)]
    for bnr in row_blocks(N, gated):
        out.append((replace(plan, block_n_rows=bnr), 16))
        out += [(replace(plan, block_n_rows=bnr, tiles=tiles), 64) for tiles in (1, 2, 4)]
    return out


def _measure(bench, name, plan, M, rows, errors):
    try:
        us = bench.time(name, plan, M)
    except Exception as error:  # noqa: BLE001 - one failing candidate never ends the sweep
        errors.setdefault("time", []).append(f"{name} {plan.fields()} M={M}: {error!r}"[:400])
        return None
    rows.append({"gemm": name, "plan": plan.fields(), "rows": M, "us": round(us, 2)})
    return us


def _phase2(bench, name, plans, rows, errors, left):
    """The best checked full plan of one weight among its finalists (None when none passed)."""
    scored = []
    for plan in plans:
        for fixup in (False, True) if plan.splits > 1 else (False,):
            if left() < 0:
                break
            option, total = _best_spread(bench, name, replace(plan, fixup=fixup), rows, errors)
            if option is None:
                continue
            problem = _checked(bench, name, option, errors)
            rows.append({"gemm": name, "plan": option.fields(), "score_us": round(total, 2), "check": problem or "ok"})
            print(f"  {name:8s} {option.fields()} t1+t16+t64 {total:7.1f} us  {problem or 'bit-invariant, near fp32'}", flush=True)
            if not problem:
                scored.append((total, option))
    if not scored:
        return None
    total, plan = min(scored, key=lambda item: item[0])
    print(f"  {name:8s} BEST {plan.fields()} ({total:.1f} us for M = 1 + 16 + 64)", flush=True)
    return plan


def _best_spread(bench, name, plan, rows, errors):
    """(plan with the many-row block and tiles of least t16 + t64, t1 + t16 + t64), or (None, None)."""
    times = {}
    for variant, m in _variants(name, plan):
        us = _measure(bench, name, variant, m, rows, errors)
        if us is not None:
            times[(variant.block_n_rows, variant.tiles if m == 64 else None, m)] = us
    t1 = times.get((plan.block_n_rows, None, 1))
    pairs = [(times[(bnr, None, 16)] + times[(bnr, tiles, 64)], bnr, tiles) for (bnr, tiles, m) in times
             if m == 64 and (bnr, None, 16) in times]
    if t1 is None or not pairs:
        return None, None
    many, bnr, tiles = min(pairs)
    return replace(plan, block_n_rows=bnr, tiles=tiles), t1 + many


def _checked(bench, name, plan, errors) -> str:
    try:
        return bench.check(name, plan)
    except Exception as error:  # noqa: BLE001
        errors.setdefault("check", []).append(f"{name} {plan.fields()}: {error!r}"[:400])
        return f"check failed: {error!r}"[:200]


def table(best: dict, processors: int) -> dict:
    """The JSON table: "N,K,gated,element_bytes,processors" -> plan fields (plan.EXACT_TILES' rows)."""
    return {f"{N},{K},{int(gated)},2,{processors}": plan.fields() for (N, K, gated), plan in best.items()}


def python_table(best: dict, processors: int) -> str:
    """The same as lines to paste into plan.EXACT_TILES."""
    lines = [f"    ({N}, {K}, {gated}, 2, {processors}): ExactLinearPlan{tuple(plan.fields())}," for (N, K, gated), plan in best.items()]
    return "\n".join(lines)
