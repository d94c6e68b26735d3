"""``dflash-trt demo``: the embedded default pair, end to end, on this machine (CPU is enough).

1. Export ``export/default_pair/{target,draft}`` (or ``--target/--draft``) to
   ONNX in a cache dir (fp32, for ONNX Runtime's CPU provider); skipped when
   the cached export already matches the checkpoints, options and code.
2. Serve a few code prompts (``export/default_pair/prompts.jsonl``, held
   out from training) through the runtime with ONNX Runtime: continuous
   batching, DFlash cycles; then the same prompts with plain target decoding
   (the baseline: same backend, no draft).
3. Print each completion, then τ, DFlash's and plain decoding's tokens/s
   and the speedup (``runtime.command.summary``: the report's definitions);
   write both runs' stats as Parquet (``OUT/dflash``, ``OUT/plain``) and
   the analysis report (Markdown + plots, with the baseline) beside them.

It runs the whole pipeline (export, runtime, analysis), so it sits beside the
console command rather than in any one stage.

The default run serves ``dflash-trt bench``'s workload (8 held-out prompts, 128
new tokens, both modes; ~10 s on two CPU cores once the export is cached, the
first export adds ~20 s). Its figures come from one pass per mode without a
warm-up: a look, not a measurement (``dflash-trt bench`` warms up; single runs
swing by ±20% on a shared box). Fewer, shorter completions show less: at 4
prompts × 64 tokens τ drops to ~2.9 and DFlash does not gain on the CPU (~0.95×).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from dflash_trt.cli import check_sampling_flags, positive_int
from dflash_trt.export import DEFAULT_PAIR_DIR
from dflash_trt.runtime import command
from dflash_trt.runtime.command import check_runnable_export
from dflash_trt.runtime.executor import Executor

DEMO_MAX_OWNERS = 2  # fewer static graphs: a faster first export, and its 4 sessions still pack
DEMO_MAX_SESSIONS = 4
DEMO_MAX_CHUNK = 256
# At most 7 proposals verified (P; the draft's block allowing): on a CPU the draft's LM head is compute, ~0.86 ms of
# a 3 ms draft at 2 owners over 15 rows per owner, and the policy verified more than 7 in few launches there:
# the head over 7 rows makes a cycle ~5% cheaper (benchmarks/RESULTS.md, "The main job's export verifies 7").
DEMO_PROPOSALS = 7
DEMO_PROMPTS, DEMO_NEW_TOKENS = 8, 128  # dflash-trt bench's workload: the main job shows what the benchmark measures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pair = DEFAULT_PAIR_DIR
    parser.add_argument("--target", type=Path, default=pair / "target", help="target checkpoint (default: the embedded pair)")
    parser.add_argument("--draft", type=Path, default=pair / "draft", help="draft checkpoint (default: the embedded pair)")
    parser.add_argument("--prompts", type=Path, default=pair / "prompts.jsonl", help="JSONL of {prompt | tokens, name?}")
    parser.add_argument("--count", type=positive_int, default=DEMO_PROMPTS, help=f"prompts to serve (default {DEMO_PROMPTS})")
    parser.add_argument("--prompt-tokens", type=positive_int, default=192, help="keep the last N tokens of each prompt")
    parser.add_argument("--cache", type=Path, default=command.default_cache_dir(), help="export cache (default ~/.cache/dflash-trt or $DFLASH_TRT_CACHE)")
    parser.add_argument("--artifacts", type=Path, help="use this export dir instead of exporting")
    parser.add_argument("--out", type=Path, help="stats + report dir (default: CACHE/demo-run)")
    command.add_generation_arguments(parser)
    parser.set_defaults(max_new_tokens=DEMO_NEW_TOKENS, max_sessions=DEMO_MAX_SESSIONS)


def export_dir(args) -> Path:
    """The pair's ONNX export in the cache (re-exported only when inputs changed)."""
    if args.artifacts is not None:
        return args.artifacts
    from dflash_trt.export.config import load_draft_config
    from dflash_trt.export.exporter import ExportOptions, export_pair

    name = hashlib.sha256(f"{args.target.resolve()}|{args.draft.resolve()}".encode()).hexdigest()[:12]
    out = args.cache / "export" / name
    proposals = min(DEMO_PROPOSALS, load_draft_config(args.draft).block_size - 1)
    options = ExportOptions(max_owners=DEMO_MAX_OWNERS, max_sessions=DEMO_MAX_SESSIONS, max_chunk=DEMO_MAX_CHUNK, proposals=proposals, dtype="fp32",
                            live_keys=True)
    started = time.perf_counter()
    print(f"export: {args.target} + {args.draft} -> {out} (cached after the first run)", flush=True)
    export_pair(args.target, args.draft, out, options, progress=True)
    print(f"export: ready in {time.perf_counter() - started:.1f} s", flush=True)
    return out


def run(args: argparse.Namespace) -> int:
    check_sampling_flags(args)
    artifacts = export_dir(args)
    check_runnable_export(artifacts, "cpu")
    tokenizer = command.load_tokenizer(artifacts, args.target)
    out = args.out or args.cache / "demo-run"
    stop = tokenizer.stop_ids if tokenizer is not None else ()
    figures = {}
    with command.open_onnxruntime(artifacts, args.max_sessions, args.threads) as backend:
        prompts = command.read_prompts(args.prompts, tokenizer, args.count)
        room = min(args.max_new_tokens, backend.dims.max_context - 1)
        prompts = [command.Prompt(p.name, command.fit_prompt(p.tokens[-args.prompt_tokens :], backend.dims.max_context, room), None) for p in prompts]
        print(f"serving {len(prompts)} prompts with ONNX Runtime (CPU), {args.max_new_tokens} new tokens each: "
              f"DFlash, then plain decoding (the baseline) ...", flush=True)
        for mode, speculate in (("dflash", True), ("plain", False)):
            with Executor(backend, max_cycles=args.max_cycles, speculate=speculate) as executor:
                completions = command.serve(executor, prompts, args, stop)
                figures[mode] = command.summary(executor, completions)
                stats, _ = executor.write_stats(out / mode / "stats")
                command.write_outputs(out / mode, prompts, completions, tokenizer)
                if speculate:
                    _print_completions(prompts, completions, tokenizer)
    report = _report(out / "dflash" / "stats.parquet", out / "plain" / "stats.parquet", out / "report")
    dflash, plain = figures["dflash"], figures["plain"]
    speedup = round(dflash["tokens_per_s"] / plain["tokens_per_s"], 2) if dflash["tokens_per_s"] and plain["tokens_per_s"] else None
    print(f"\nτ (tokens per draft/verify cycle) = {dflash['tau']}   DFlash {dflash['tokens_per_s']} tokens/s   "
          f"plain decoding {plain['tokens_per_s']} tokens/s   speedup {speedup}x")
    print(f"stats: {out / 'dflash'} and {out / 'plain'}   report: {report}")
    print(json.dumps({**dflash, "plain_tokens_per_s": plain["tokens_per_s"], "speedup": speedup}))
    return 0


def _print_completions(prompts, completions, tokenizer) -> None:
    for prompt, completion in zip(prompts, completions):
        print(f"\n=== {prompt.name} ({len(prompt.tokens)} prompt tokens, {len(completion.tokens)} new, {completion.finish}) ===")
        if tokenizer is None:
            print(completion.tokens)
            continue
        tail = tokenizer.decode(prompt.tokens).splitlines()[-3:]
        print("\n".join(f"  | {line}" for line in tail))
        print(tokenizer.decode(completion.tokens))


def _report(cycles: Path, baseline: Path, out: Path) -> Path:
    """The analysis report of the run against its baseline: its summary.md, or the report folder."""
    from dflash_trt.analysis.load import scan_run
    from dflash_trt.analysis.report import summarize, write_report

    files = write_report(summarize(scan_run(cycles), scan_run(baseline)), out)
    return out / "summary.md" if "summary.md" in {Path(f).name for f in files.values()} else out


if __name__ == "__main__":  # python -m dflash_trt.demo
    from dflash_trt.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
