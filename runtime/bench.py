"""``dflash-trt bench``: plain target decoding vs DFlash on the same prompts, through the same runtime.

    dflash-trt bench --out bench/                                   # the embedded pair, ONNX Runtime (CPU)
    dflash-trt bench --backend torch --device cuda --out bench/     # its checkpoints on a GPU, no export
    dflash-trt bench --artifacts EXPORT_DIR --prompts p.jsonl --limit 8 --out bench/

The ``run`` flags (backends, artifacts, prompts). One backend, two executors
over it: ``speculate=False`` (plain decoding, the baseline: prefill, then
``target_decode_n`` steps) and DFlash (under ``--policy``: adaptive by
default, ``always`` to cycle whenever a block fits), with the same prompts, sampling,
stop tokens and stats schema. Each first serves the prompts once untimed
(``--warmup``, the default: CUDA graphs are captured there), then again
with fresh stats. Writes per mode ``OUT/<mode>/outputs.jsonl`` and
``OUT/<mode>/stats.parquet`` (+ executes), prints a table and, last, one
JSON line with both modes' figures (``command.summary``: the definitions of
``dflash-trt report``) and the speedup. Render the comparison with
``dflash-trt report OUT/dflash/stats.parquet --baseline OUT/plain/stats.parquet``.

    dflash-trt bench --serve http://127.0.0.1:8000 [--concurrency 8] [--num-prompts 64] [--max-new-tokens 128]

measures a running server as a client instead (TTFT, TPOT, ITL, E2E,
throughput; ``dflash_trt.server.bench``): nothing is loaded here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_trt.cli import positive_int
from dflash_trt.runtime import command
from dflash_trt.runtime.executor import Executor

MODES = (("plain", False), ("dflash", True))  # (name, speculate): the baseline first
COLUMNS = ("tokens_per_s", "tau", "tokens", "seconds", "cycles", "calls", "ms_per_launch", "host_overhead_fraction", "gpu_idle_fraction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    command.add_arguments(parser, out_required=False)
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
    if args.out is None:
        from dflash_trt.errors import UsageError

        raise UsageError("dflash-trt bench needs --out DIR (or --serve URL to measure a running server)")
    if args.no_draft:
        from dflash_trt.errors import UsageError

        raise UsageError("--no-draft does not apply to bench: it runs plain decoding and DFlash both")
    command.check_flags(args)
    command.prepare_artifacts(args)
    tokenizer = command.load_tokenizer(args.tokenizer, args.artifacts, args.target)
    stop = command.stop_tokens(args, tokenizer)
    prompts = command.read_prompts(args.prompts, tokenizer, args.limit)
    figures, outputs, rates = {}, {}, {}
    with command.open_backend(args) as backend:
        fitted = command.fit_prompts(prompts, args.max_new_tokens, backend.dims.max_context)
        for mode, speculate in MODES:
            with command.make_executor(backend, args, speculate) as executor:
                figures[mode], outputs[mode] = measure(executor, fitted, args, tokenizer, stop, args.out / mode)
                rates[mode] = command.run_overview(executor)["tokens_per_s"]
    result = comparison(figures, outputs, rates) | {"policy": args.policy}
    print(table(figures))
    print(f"speedup (DFlash tokens/s over plain decoding's): {result['speedup']}x; wrote {args.out / 'plain'} and "
          f"{args.out / 'dflash'}; compare: dflash-trt report {args.out / 'dflash' / 'stats.parquet'} "
          f"--baseline {args.out / 'plain' / 'stats.parquet'}")
    print(json.dumps(result))
    return 0


def measure(executor: Executor, prompts: list[command.Prompt], args, tokenizer, stop, out: Path | None) -> tuple[dict, list[list[int]]]:
    """Serve ``prompts`` (after an untimed pass with ``args.warmup``); the run's figures and outputs, written to ``out``."""
    if args.warmup:
        command.serve(executor, prompts, args, stop)
        executor.clear_stats()
        executor.loop.timeline.reset()
    completions = command.serve(executor, prompts, args, stop)
    if out is not None:
        command.write_outputs(out, prompts, completions, tokenizer)
        executor.write_stats(out / "stats")
    return command.summary(executor, completions), [c.tokens for c in completions]


def comparison(figures: dict[str, dict], outputs: dict[str, list[list[int]]], rates: dict[str, float | None]) -> dict:
    """Both modes' figures, the speedup (DFlash tokens/s over plain decoding's, from the unrounded
    ``rates``, as ``dflash-trt report --baseline`` computes it) and how many outputs agree (all of
    them at T=0 in exact arithmetic; reduced precision may flip near-ties)."""
    plain, dflash = rates["plain"], rates["dflash"]
    same = sum(a == b for a, b in zip(outputs["plain"], outputs["dflash"]))
    return {
        "plain": figures["plain"],
        "dflash": figures["dflash"],
        "speedup": round(dflash / plain, 3) if plain and dflash else None,
        "identical_outputs": same,
        "prompts": len(outputs["plain"]),
    }


def table(figures: dict[str, dict]) -> str:
    """A Markdown table: one row per mode."""
    lines = ["| mode | " + " | ".join(COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1)]
    for mode, row in figures.items():
        lines.append(f"| {mode} | " + " | ".join(str(row.get(k)) for k in COLUMNS) + " |")
    return "\n".join(lines)
