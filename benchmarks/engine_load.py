"""The engine alone under continuous batching: DFlash against plain decoding, per kernels choice and session count.

    python benchmarks/engine_load.py [--sessions 16 64] [--kernels fast exact] [--repeats 3]
        [--requests-per-session 8] [--max-new-tokens 64] [--device cuda] [--record]

The default pair (bf16 on CUDA, fp32 on the CPU) on the torch backend: for each ``--kernels`` choice one
backend, and for each session count S and mode (DFlash with the default policy, then plain decoding)
``generate.stream`` over 8·S held-out prompts (``--requests-per-session``), S at a time — a warm-up pass
(captures, compiles), then ``--repeats`` measured passes. No HTTP, no tokenizer, no client: what the
engine itself delivers, and where a launch's time goes (device-busy ms per launch from the loop's own
events, against the wall per launch: a wall well above the busy time is host-bound).

Kernels choices: ``fast`` (the default on CUDA in fp32 and fp16: cuBLAS for M > 1 with the norm and SiLU·mul as their own
kernels, a one-row GEMV at M = 1), ``exact`` (``ExactOps``, the default in bf16: batch-invariant tiles, SiLU·mul and residual
fused in, the attention's splits folded in its own launch) and ``exact-2l`` (``ExactOps(combine_in_kernel=False)``:
the splits folded by a second launch).

Prints one table (median tok/s of the repeats, DFlash / plain, busy and wall ms per launch) and ends with
one JSON line; ``--record`` appends a row per (kernels, sessions, mode) and the summary to results.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from gpu_e2e import default_pair, dims_of, machine  # noqa: E402
from host_profile import serve  # noqa: E402

from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.serving.batcher import Request  # noqa: E402


def exact_ops(combine_in_kernel: bool):
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    return ExactOps(combine_in_kernel=combine_in_kernel)


KERNELS = {  # choice -> the backend's kernels= argument (made per backend)
    "fast": lambda: "fast",
    "exact": lambda: exact_ops(True),
    "exact-2l": lambda: exact_ops(False),
}


def measure(executor: Executor, requests: list[Request], sessions: int, repeats: int) -> dict:
    """Median tok/s of ``repeats`` passes after a warm-up, with the loop's launches and device-busy ms."""
    serve(executor, requests[: sessions * 2], sessions)  # captures, compiles, the allocator's pools
    passes = []
    for _ in range(repeats):
        executor.loop.timeline.reset()
        tokens, seconds = serve(executor, requests, sessions)
        timeline = executor.loop.timeline
        passes.append((tokens / seconds, timeline.launches, timeline.busy_ms, seconds * 1e3))
    rate, launches, busy_ms, wall_ms = sorted(passes)[len(passes) // 2]  # the median pass, whole
    return {
        "tok_s": round(rate), "passes_tok_s": [round(p[0]) for p in passes], "launches": launches,
        "busy_ms_per_launch": round(busy_ms / max(launches, 1), 4), "wall_ms_per_launch": round(wall_ms / max(launches, 1), 4),
    }


def run(args: argparse.Namespace) -> list[dict]:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, draft, prompts, stop = default_pair(dtype)
    rows = []
    for sessions in args.sessions:
        dims = dims_of(target, draft, sessions, dtype)
        count = sessions * args.requests_per_session
        requests = [Request(prompts[i % len(prompts)], args.max_new_tokens, stop) for i in range(count)]
        for choice in args.kernels:
            started = time.perf_counter()
            backend = TorchBackend(target, draft, dims, sessions, device=args.device, kernels=KERNELS[choice]())
            try:
                for speculate in (True, False):
                    with Executor(backend, max_sessions=sessions, speculate=speculate) as executor:
                        row = measure(executor, requests, sessions, args.repeats)
                    rows.append({"kernels": choice, "sessions": sessions, "speculate": speculate, **row,
                                 "setup_and_run_s": round(time.perf_counter() - started, 1)})
                    print(rows[-1], flush=True)
            finally:
                backend.close()
    return rows


def table(rows: list[dict]) -> list[dict]:
    """One line per (kernels, sessions): both modes side by side and their ratio."""
    lines = []
    for on in (row for row in rows if row["speculate"]):
        off = next(r for r in rows if not r["speculate"] and (r["kernels"], r["sessions"]) == (on["kernels"], on["sessions"]))
        lines.append({
            "kernels": on["kernels"], "sessions": on["sessions"], "dflash_tok_s": on["tok_s"], "plain_tok_s": off["tok_s"],
            "ratio": round(on["tok_s"] / off["tok_s"], 3), "busy_ms_per_launch": [on["busy_ms_per_launch"], off["busy_ms_per_launch"]],
            "wall_ms_per_launch": [on["wall_ms_per_launch"], off["wall_ms_per_launch"]],
        })
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=["fast", "exact"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests-per-session", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--record", action="store_true", help="append the rows and the summary to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.repeats < 1 or min(args.sessions) < 1:
        parser.error(f"--repeats and --sessions must be >= 1, got {args.repeats} and {args.sessions}")
    if args.device != "cuda" and set(args.kernels) - {"fast"}:
        parser.error(f"--kernels {' '.join(args.kernels)}: only 'fast' (its CPU twin) runs without --device cuda")
    rows = run(args)
    lines = table(rows)
    print("| kernels | sessions | DFlash tok/s | plain tok/s | DFlash / plain | busy ms per launch (on / off) | wall ms per launch (on / off) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for line in lines:
        busy, wall = line["busy_ms_per_launch"], line["wall_ms_per_launch"]
        print(f"| {line['kernels']} | {line['sessions']} | {line['dflash_tok_s']:,} | {line['plain_tok_s']:,} | {line['ratio']:.3f}× "
              f"| {busy[0]} / {busy[1]} | {wall[0]} / {wall[1]} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(["python", *sys.argv])}
    if args.record:
        record.append_rows([{"name": "engine_load", **meta, **row} for row in rows])
    return record.finish({"name": "engine_load_summary", **meta, "repeats": args.repeats, "table": lines}, args.record)


if __name__ == "__main__":
    sys.exit(main())
