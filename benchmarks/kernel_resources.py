"""What the exact attention costs a Hopper processor, read from its compile (no GPU): registers, stack, shared memory,
SASS instructions, and how many programs fit one SM by each limit.

    python benchmarks/kernel_resources.py [--stages 2 3] [--warps 4] [--record]
    python benchmarks/kernel_resources.py --linear fp8 [--record]    # the exact linear with fp8 weights instead
    python benchmarks/kernel_resources.py --linear wide [--record]   # bf16: four 16-row tiles against one 64-row tile

Compiles ``exact_ops._attention_kernel`` (the splits folded in the launch, and by a second launch) and
``_combine_kernel`` for sm90 at the Qwen3-8B head shape (head_dim 128, 16-row query tiles, 64-slot steps, 256-slot
splits, causal, PDL), with the integer strides and pointers a launch passes known 16-divisible, as Triton
specializes them at a launch: without that it compiles scalar loads and other registers. Run under the Triton the
GPU will run (the GPU machine's, or a copy of it on ``PYTHONPATH``): compilers differ. Why: a kernel change that
keeps every bit can still make a launch a fifth slower by holding more registers (benchmarks/RESULTS.md, "The exact
attention's fold with eight splits' loads at once": 146 -> 203 registers, three programs per SM -> two, a four-owner
verify's attention 39.3 -> 47.6 µs per layer; ``test_exact_attention_holds_three_programs_per_sm`` now holds the
product to three). ``--linear fp8`` compiles ``exact_ops._linear_kernel`` instead, with fp8 weights (a draft's
``draft_weights="fp8"``) at the Qwen3-8B weights' shapes, as the plan launches them at 16 and 64 rows and with the
64-row launch at 1, 2 and 4 tiles per program (the widened fp8 tiles are held in registers). ``--linear wide`` compiles
it with bf16 weights at 64 and 128 rows as four 16-row tiles a program and as one 64-row tile (``ExactOps.wide_tiles``:
the warp-group MMA, whose operands wait in shared memory), at the plan's pipeline depth and one stage less, with the
launch's programs and the waves they take on 132 SMs at the programs an SM holds. Prints a table and ends with one JSON
line; ``--record`` appends one row.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: results.jsonl

# An H100 / H200 SM (sm90): registers, shared memory (of which the driver keeps 1 KiB per program), threads, programs
SM_REGISTERS, SM_SHARED, PROGRAM_RESERVED, SM_THREADS, SM_PROGRAMS = 65536, 233472, 1024, 2048, 32
SHAPE = {"D": 128, "BLOCK_Q": 16, "BLOCK_N": 64, "SPLIT": 256, "CAUSAL": True, "WINDOW": False, "ROWS": True, "INTERP": False, "PDL": True}
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32",
            "pos_ptr": "*i64", "len_ptr": "*i64", "rows_ptr": "*i64", "cnt_ptr": "*i32"}
ALIGNED = {"sq_n", "sq_h", "sq_t", "sk_n", "sk_h", "sk_l", "so_n", "so_h", "so_t"}  # multiples of 16 at this shape


def signature(kernel, constexprs: dict, pointers: dict | None = None, aligned_names: set | None = None) -> tuple[dict, dict]:
    """The kernel's argument types by name (pointers by ``pointers``, default ``POINTERS``; ``scale`` fp32, other
    integers i32) and the 16-divisible ones (every pointer, the names in ``aligned_names``, default ``ALIGNED``) as
    Triton's attributes."""
    pointers = POINTERS if pointers is None else pointers
    aligned_names = ALIGNED if aligned_names is None else aligned_names
    names = list(inspect.signature(kernel.fn).parameters)
    types = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "scale" else "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n in aligned_names}
    return types, aligned


def programs_per_sm(registers: int, shared: int, warps: int) -> dict:
    """Programs one SM holds by each limit (registers allocated per warp in 256s)."""
    per_warp = -(-registers * 32 // 256) * 256
    return {"by_registers": SM_REGISTERS // (per_warp * warps), "by_shared": SM_SHARED // (shared + PROGRAM_RESERVED),
            "by_threads": min(SM_THREADS // (32 * warps), SM_PROGRAMS)}


def resources(kernel, constexprs: dict, warps: int, stages: int, registers: int | None = None, pointers: dict | None = None,
              aligned_names: set | None = None) -> dict:
    """One compile for sm90 (``registers``: the launch's cap, ``maxnreg``; ``pointers``, ``aligned_names``: as
    ``signature``'s, for another kernel than the attention): registers, stack bytes, shared bytes, SASS
    instructions, local loads / stores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types, aligned = signature(kernel, constexprs, pointers, aligned_names)
    source = ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages, **({"maxnreg": registers} if registers else {})})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    held, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    shared = compiled.metadata.shared
    return {"registers": held, "stack_bytes": stack, "shared_bytes": shared,
            "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.MULTILINE)),
            "local_accesses": len(re.findall(r"\b(?:LDL|STL)\b", sass)), **programs_per_sm(held, shared, warps)}


LINEAR_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "b_ptr": "*bf16", "s_ptr": "*fp32", "r_ptr": "*bf16", "o_ptr": "*bf16",
                   "t_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
LINEAR_ALIGNED = {"stride_xm", "stride_wn", "stride_rm", "stride_om", "stride_tm", "N", "K", "KS"}  # the 8B weights' sizes


def linear_rows() -> list[dict]:
    """The exact linear with fp8 weights: each 8B weight's launches at 16 and 64 rows as the plan makes them, and the
    64-row launch at 1, 2 and 4 tiles per program."""
    from dataclasses import replace

    from gpu_graphs import GEMMS  # the 8B step's weights: (N, K, gated, norm prologue, residual, fp32 out)

    from dflash_trt.runtime.kernels import exact_ops
    from dflash_trt.runtime.kernels.plan import EXACT_SHARED_BYTES, exact_linear_launch, exact_linear_plan

    rows = []
    for name, (N, K, gated, norm, residual, _) in GEMMS.items():
        plan = exact_linear_plan(N, K, gated, 1)
        launches = [(M, "plan", plan) for M in (16, 64)] + [(64, f"{t} tiles", replace(plan, tiles=t)) for t in (1, 2, 4) if t != plan.tiles]
        for M, label, chosen in launches:
            tiles, block_n, stages = exact_linear_launch(chosen, M, gated, 1, N, 132, EXACT_SHARED_BYTES, 2)
            constexprs = dict(GATED=gated, BIAS=False, RESIDUAL=residual, TAP=False, SCALED=True, SPLITS=chosen.splits, FIXUP=chosen.fixup,
                              TILES=tiles, TM=16, BN=block_n, BK=chosen.block_k, INTERP=False, PDL=True)
            found = resources(exact_ops._linear_kernel, constexprs, chosen.warps, stages, pointers=LINEAR_POINTERS, aligned_names=LINEAR_ALIGNED)
            rows.append({"weight": name, "rows": M, "launch": label, "tiles": tiles, "block_n": block_n, "stages": stages, **found})
            r = rows[-1]
            print(f"| {name} | {M} | {label} | {tiles} | {block_n} | {stages} | {r['registers']} | {r['stack_bytes']} | {r['shared_bytes']} | "
                  f"{r['local_accesses']} | {r['by_registers']}, {r['by_shared']} |", flush=True)
    return rows


def wide_rows() -> list[dict]:
    """The exact linear with bf16 weights: each 8B weight's launch of four 16-row tiles a program at 64 and 128 rows
    (the table's tiles raised to four where it holds fewer), against the same rows as one 64-row tile, at the
    launch's stages and one less; the programs and the waves they take on 132 SMs."""
    from dataclasses import replace

    from dflash_trt.runtime.kernels import exact_ops
    from dflash_trt.runtime.kernels.plan import EXACT_SHARED_BYTES, cdiv, exact_linear_launch, exact_linear_plan
    from gpu_graphs import GEMMS

    pointers = LINEAR_POINTERS | {"w_ptr": "*bf16", "s_ptr": "*bf16"}
    rows = []
    for name, (N, K, gated, norm, residual, _) in GEMMS.items():
        plan = replace(exact_linear_plan(N, K, gated, 2), tiles=4)
        for M in (64, 128):
            tiles, block_n, stages = exact_linear_launch(plan, M, gated, 2, N, 132, EXACT_SHARED_BYTES)
            for label, tm, depth in (("16-row tiles", 16, stages), ("64-row tile", 64, stages), ("64-row tile", 64, stages - 1)):
                constexprs = {"GATED": gated, "BIAS": False, "RESIDUAL": residual, "TAP": False, "SCALED": False, "SPLITS": plan.splits,
                              "FIXUP": plan.fixup, "TILES": tiles * 16 // tm, "TM": tm, "BN": block_n, "BK": plan.block_k, "INTERP": False,
                              "PDL": True}
                found = resources(exact_ops._linear_kernel, constexprs, plan.warps, depth, pointers=pointers, aligned_names=LINEAR_ALIGNED)
                programs = cdiv(M, tiles * 16) * cdiv(N, block_n) * plan.splits
                held = min(found["by_registers"], found["by_shared"], found["by_threads"])
                rows.append({"weight": name, "rows": M, "launch": label, "block_n": block_n, "stages": depth, "programs": programs,
                             "waves": round(programs / (132 * held), 2), **found})
                r = rows[-1]
                print(f"| {name} | {M} | {label} | {block_n} | {depth} | {r['registers']} | {r['shared_bytes']} | "
                      f"{r['by_registers']}, {r['by_shared']} | {programs} | {r['waves']} |", flush=True)
    return rows


# --linear: (what is compiled, the table's header, the rows' function)
LINEAR_REPORTS = {
    "fp8": ("fp8 weights, bf16 rows", ("| weight | rows | launch | tiles | features | stages | registers | stack B | shared B | local ld/st | "
                                       "programs / SM: registers, shared |"), linear_rows),
    "wide": ("bf16, four 16-row tiles a program against one 64-row tile", ("| weight | rows | launch | features | stages | registers | "
                                                                            "shared B | programs / SM: registers, shared | programs | "
                                                                            "waves on 132 SMs |"), wide_rows),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="key / value steps in flight (the product: 3 at this shape)")
    parser.add_argument("--warps", type=int, default=4, help="warps per program (the product's attention: 4)")
    parser.add_argument("--linear", choices=("fp8", "wide"), help="the exact linear (fp8 weights; or bf16 in 16-row tiles against one 64-row tile) instead of the attention")
    parser.add_argument("--record", action="store_true", help="append a row to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.linear:
        import triton

        title, header, rows = LINEAR_REPORTS[args.linear]
        print(f"sm90, Triton {triton.__version__}: the exact linear, {title}\n")
        print(header)
        print("|" + " --- |" * header.count(" | ") + " --- |")
        result = {"name": f"kernel_resources_linear_{args.linear}", "machine": "CPU (compiled for sm90)", "triton": triton.__version__,
                  "command": "python benchmarks/kernel_resources.py " + " ".join(sys.argv[1:]), "rows": rows()}
        if args.record:
            record.append_rows([result])
        print(json.dumps(result))
        return

    import triton
    from dflash_trt.runtime.kernels import exact_ops

    kernels = {"attention, folded in the launch": (exact_ops._attention_kernel, SHAPE | {"COMBINE": True}),
               "attention, folded by a second launch": (exact_ops._attention_kernel, SHAPE | {"COMBINE": False}),
               "the second launch's fold": (exact_ops._combine_kernel, {k: SHAPE[k] for k in ("D", "BLOCK_Q", "BLOCK_N", "SPLIT", "CAUSAL", "WINDOW", "PDL")})}
    rows = []
    print(f"sm90, Triton {triton.__version__}, {args.warps} warps per program\n")
    print("| kernel | stages | registers | stack B | shared B | SASS | local ld/st | programs / SM: registers, shared, threads |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, (kernel, constexprs) in kernels.items():
        for stages in args.stages if kernel is exact_ops._attention_kernel else args.stages[-1:]:
            row = {"kernel": label, "stages": stages, **resources(kernel, constexprs, args.warps, stages)}
            rows.append(row)
            print(f"| {label} | {stages} | {row['registers']} | {row['stack_bytes']} | {row['shared_bytes']} | {row['sass_instructions']} | "
                  f"{row['local_accesses']} | {row['by_registers']}, {row['by_shared']}, {row['by_threads']} |", flush=True)
    result = {"name": "kernel_resources", "machine": "CPU (compiled for sm90)", "triton": triton.__version__,
              "command": "python benchmarks/kernel_resources.py " + " ".join(sys.argv[1:]), "warps": args.warps, "rows": rows}
    if args.record:
        record.append_rows([result])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
