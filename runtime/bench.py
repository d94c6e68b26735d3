"""``dflash-trt bench``: plain target decoding vs DFlash on the same prompts, through the same runtime.

    dflash-trt bench --artifacts EXPORT_DIR --backend torch --target T --draft D --prompts p.jsonl --out bench/

One backend, two executors over it: ``speculate=False`` (the autoregressive
baseline: prefill, then ``target_decode_n`` steps) and DFlash, with the same
prompts, sampling, stop tokens and stats schema. Each first serves the
prompts once untimed (``--warmup``, the default: CUDA graphs are captured
there), then again with fresh stats. Writes per mode ``OUT/<mode>/
outputs.jsonl`` and ``OUT/<mode>/stats.parquet`` (+ executes), prints a
table (tokens/s, τ, ms per launch, host overhead, device idle) and, last, one
JSON line with both modes' figures and the speedup. Render the comparison
with ``dflash-trt report OUT/dflash/stats.parquet --baseline OUT/ar/stats.parquet``.

    dflash-trt bench --serve http://127.0.0.1:8000 [--concurrency 8] [--num-prompts 64] [--max-new-tokens 128]

measures a running server as a client instead (TTFT, TPOT, ITL, E2E,
throughput; ``dflash_trt.server.bench``): nothing is loaded here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_trt.runtime import command
from dflash_trt.runtime.executor import Executor

from dflash_trt.cli import positive_int
from dflash_trt.errors import InputError

MODES = (("ar", False), ("dflash", True))  # (name, speculate)
COLUMNS = ("tokens_per_s", "tau", "ms_per_call", "host_overhead_fraction", "gpu_idle_fraction", "tokens", "seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    command.add_arguments(parser, required=False)
    parser.set_defaults(no_draft=False)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="time the first pass (captures included)")
    client = parser.add_argument_group("client mode (--serve URL): measure a running server")
    client.add_argument("--serve", metavar="URL", help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000): load it and time its streams")
    client.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight at once (default 8)")
    client.add_argument("--num-prompts", type=positive_int, default=64, help="requests to send (default 64; the prompts file cycled)")
    client.add_argument("--model", help="model name to send (default: the server's first)")
    client.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before it counts as failed (default 600)")


def run(args: argparse.Namespace) -> int:
    if args.serve is not None:
        from dflash_trt.server.bench import run as run_client

        return run_client(args)
    missing = [flag for flag, value in (("--artifacts", args.artifacts), ("--prompts", args.prompts), ("--out", args.out)) if value is None]
    if missing:
        raise InputError(f"dflash-trt bench needs {', '.join(missing)} (or --serve URL to measure a running server)")
    tokenizer = command.load_tokenizer(args.tokenizer, args.artifacts, args.target)
    figures: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    with command.OPENERS[args.backend](args) as backend:
        stop = command.stop_tokens(args, tokenizer)
        for mode, speculate in MODES:
            with command.make_executor(backend, args, speculate) as executor:
                figures[mode], outputs[mode] = _measure(executor, args, tokenizer, stop, args.out / mode)
    result = comparison(figures, outputs)
    print(table(figures))
    print(f"wrote {args.out / 'ar'} and {args.out / 'dflash'}; compare: dflash-trt report "
          f"{args.out / 'dflash' / 'stats.parquet'} --baseline {args.out / 'ar' / 'stats.parquet'}")
    print(json.dumps(result))
    return 0


def _measure(executor: Executor, args, tokenizer, stop, out: Path) -> tuple[dict, list[list[int]]]:
    prompts = command.load_prompts(args, tokenizer, executor.dims.max_context)
    if args.warmup:
        command.serve(executor, prompts, args, stop)
        executor.clear_stats()
        executor.loop.timeline.reset()
    completions, seconds = command.serve(executor, prompts, args, stop)
    command.write_outputs(out, prompts, completions, tokenizer)
    executor.write_stats(out / "stats")
    return command.summary(executor, completions, seconds), [c.tokens for c in completions]


def comparison(figures: dict[str, dict], outputs: dict[str, list[list[int]]]) -> dict:
    """Both modes' figures, the speedup (DFlash tokens/s over AR tokens/s) and how many outputs agree
    (all of them at T=0 in exact arithmetic; reduced precision may flip near-ties)."""
    ar, dflash = figures["ar"]["tokens_per_s"], figures["dflash"]["tokens_per_s"]
    same = sum(a == b for a, b in zip(outputs["ar"], outputs["dflash"]))
    return {
        "ar": figures["ar"],
        "dflash": figures["dflash"],
        "speedup": round(dflash / ar, 3) if ar and dflash else None,
        "identical_outputs": same,
        "prompts": len(outputs["ar"]),
    }


def table(figures: dict[str, dict]) -> str:
    """A Markdown table: one row per mode."""
    lines = ["| mode | " + " | ".join(COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1)]
    for mode, row in figures.items():
        lines.append(f"| {mode} | " + " | ".join(str(row.get(k)) for k in COLUMNS) + " |")
    return "\n".join(lines)
