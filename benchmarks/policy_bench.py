"""The speculation policy against the fixed one and plain decoding, paired round by round on one backend.

A shared machine's load swings by 2x within seconds, so three separate runs
(``dflash-trt bench --policy adaptive``, ``--policy always``) measure the
load as much as the modes. Here the three modes serve the same prompts in
short rounds, in rotating order, on one backend (the ``run`` flags: the
embedded pair on ONNX Runtime by default): plain decoding (``--no-draft``),
DFlash under ``always`` (cycles verifying P), under ``adaptive-p`` (the
adaptive policy choosing between decode and cycles of P only: the policy
before verify lengths) and under ``adaptive`` (decode or a cycle of any of
the export's verify lengths, ``Dims.verify_proposals``). Each adaptive policy
is one object kept across rounds (what it learned carries over, as in a
server); each round opens fresh executors. Per round: each mode's tokens/s;
then per mode the median over rounds, and the median of the per-round
ratios (adaptive / plain, adaptive-p / plain, always / plain, adaptive /
adaptive-p, adaptive / always), which a load swing longer than a round
cancels out of. Outputs must be identical across modes (greedy, fp32). The
last line is one JSON object.

    python benchmarks/policy_bench.py [--rounds 9] [--limit 8] [--max-new-tokens 64] [--backend torch ...] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from dflash_trt.runtime import command
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.policy import AdaptivePolicy

import record  # benchmarks/record.py: results.jsonl

ROOT = Path(__file__).resolve().parent.parent
MODES = ("plain", "always", "adaptive-p", "adaptive")
RATIOS = (("adaptive", "plain"), ("adaptive-p", "plain"), ("always", "plain"), ("adaptive", "adaptive-p"), ("adaptive", "always"))


def serve_round(backend, args, prompts, stop, mode: str, adaptive: dict[str, AdaptivePolicy]) -> tuple[float, list[list[int]]]:
    """One pass over the prompts in ``mode``: (tokens/s over the pass's wall time, the outputs)."""
    policy = adaptive.get(mode, "always")
    with Executor(backend, max_sessions=args.max_sessions, stats_rows=None, speculate=mode != "plain", max_cycles=args.max_cycles,
                  policy=policy) as executor:
        started = time.perf_counter()
        completions = command.serve(executor, prompts, args, stop)
        seconds = time.perf_counter() - started
    outputs = [c.tokens for c in completions]
    return sum(map(len, outputs)) / seconds, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    command.add_arguments(parser, out_required=False)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    parser.set_defaults(limit=8, max_new_tokens=64)
    args = parser.parse_args()
    command.check_flags(args)
    command.prepare_artifacts(args)
    tokenizer = command.load_tokenizer(args.tokenizer, args.artifacts, args.target)
    stop = command.stop_tokens(args, tokenizer)
    prompts = command.read_prompts(args.prompts, tokenizer, args.limit)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    identical = True
    with command.open_backend(args) as backend:
        prompts = command.fit_prompts(prompts, args.max_new_tokens, backend.dims.max_context)
        lengths = backend.dims.verify_proposals
        adaptive = {"adaptive": AdaptivePolicy(lengths=lengths), "adaptive-p": AdaptivePolicy()}  # (): cycles of P only
        for mode in MODES:  # warm-up: first runs of every graph, untimed
            serve_round(backend, args, prompts, stop, mode, adaptive)
        print("| round | " + " | ".join(f"{m} tok/s" for m in MODES) + " |\n|" + " --- |" * (len(MODES) + 1), flush=True)
        for r in range(args.rounds):
            order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
            outputs = {}
            for mode in order:
                rate, outputs[mode] = serve_round(backend, args, prompts, stop, mode, adaptive)
                rates[mode].append(rate)
            identical &= all(outputs[mode] == outputs["plain"] for mode in MODES)
            print(f"| {r} | " + " | ".join(f"{rates[m][-1]:.1f}" for m in MODES) + " |", flush=True)
    ratios = {f"{a}/{b}": round(statistics.median(x / y for x, y in zip(rates[a], rates[b])), 3)
              for a, b in RATIOS}
    medians = {mode: round(statistics.median(values), 2) for mode, values in rates.items()}
    print(f"median tokens/s {medians}; median per-round ratios {ratios}; identical outputs {identical}")
    summary = {"name": "policy_bench", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/policy_bench.py", *sys.argv[1:]]), "backend": args.backend,
               "rounds": args.rounds, "prompts": len(prompts), "verify_proposals": list(lengths),
               "max_new_tokens": args.max_new_tokens, "median_tokens_per_s": medians,
               "median_ratios": ratios, "identical_outputs": identical, "tokens_per_s": {m: [round(v, 2) for v in rates[m]] for m in MODES}}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
