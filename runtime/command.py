"""``dflash-trt run``: serve a prompt file through the runtime; write outputs (JSONL) and stats (Parquet).

    dflash-trt run --artifacts EXPORT_DIR --backend onnxruntime --prompts prompts.jsonl --out run/
    dflash-trt run ... --no-draft        # the same prompts, plain target decoding (the AR baseline)

Prompt file: one JSON object per line with ``prompt`` (text; needs a
tokenizer) or ``tokens`` (ids), and optionally ``name`` and
``max_new_tokens``. The tokenizer is the target checkpoint's
``tokenizer.json`` (``--tokenizer DIR``; default: the artifacts dir, then
``--target``); stop tokens are its eos ids, else the manifest's.

Writes ``OUT/outputs.jsonl`` (per prompt: index, name, prompt_tokens, prompt_ids, tokens,
text, finish) and ``OUT/stats.parquet`` + ``OUT/stats.executes.parquet``
(``runtime.stats``), then prints one summary line: prompts, tokens, seconds,
tokens/s and τ.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path


from dflash_trt.cli import positive_int
from dflash_trt.errors import InputError, TokenizerError
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.generate import collect, stream
from dflash_trt.runtime.serving.batcher import Completion, Request
from dflash_trt.runtime.stats import TARGET

BACKEND_CHOICES = ("onnxruntime", "torch", "tensorrt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifacts", type=Path, required=True, help="export dir (manifest.json + ONNX), or engine dir for tensorrt")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="onnxruntime")
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL: {prompt | tokens, name?, max_new_tokens?} per line")
    parser.add_argument("--out", type=Path, required=True, help="output dir: outputs.jsonl, stats.parquet, stats.executes.parquet")
    add_generation_arguments(parser)
    parser.add_argument("--tokenizer", type=Path, help="dir with tokenizer.json (default: --artifacts, then --target)")
    parser.add_argument("--target", type=Path, help="target checkpoint (torch backend; tokenizer fallback)")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (torch backend)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cpu, cuda for tensorrt)")
    parser.add_argument("--limit", type=positive_int, help="serve only the first N prompts")
    parser.add_argument("--no-draft", action="store_true", help="plain target decoding (no speculation): the autoregressive baseline")


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with ``dflash-trt demo``."""
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    parser.add_argument("--max-sessions", type=positive_int, help="sessions at once (default: the artifacts' max_sessions)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for ONNX Runtime / torch")
    parser.add_argument("--max-cycles", type=positive_int, default=8, help="cycles per session per execute call (default 8)")


# ---------------------------------------------------------------------- backends


def _open_onnxruntime(args):
    from dflash_trt.runtime.backends import OrtBackend

    return OrtBackend.from_export(args.artifacts, max_sessions=args.max_sessions, device=args.device or "cpu", threads=args.threads)


def _open_torch(args):
    from dflash_trt.runtime.backends import TorchBackend

    if args.target is None or args.draft is None:
        msg = "--backend torch needs --target and --draft (checkpoint dirs); --artifacts gives the dims"
        raise InputError(msg)
    return TorchBackend.from_checkpoints(args.target, args.draft, args.artifacts, max_sessions=args.max_sessions, device=args.device or "cpu")


def _open_tensorrt(args):
    from dflash_trt.runtime.backends import TensorRTBackend

    return TensorRTBackend.open(args.artifacts, max_sessions=args.max_sessions, device=args.device or "cuda")


OPENERS = {"onnxruntime": _open_onnxruntime, "torch": _open_torch, "tensorrt": _open_tensorrt}


# ---------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    name: str
    tokens: list[int]
    max_new_tokens: int | None = None


def load_tokenizer(*directories: Path | None):
    """The first directory holding a tokenizer.json, as ``export.tokenizer.Tokenizer``; None if none does."""
    from dflash_trt.export.tokenizer import Tokenizer

    for directory in directories:
        if directory is not None and (Path(directory) / "tokenizer.json").is_file():
            return Tokenizer.from_dir(directory)
    return None


def read_prompts(path: Path, tokenizer, limit: int | None = None) -> list[Prompt]:
    """Parse the prompt file; a text prompt needs a tokenizer. Errors name the line."""
    if not Path(path).is_file():
        msg = f"--prompts: {path} is not a file"
        raise InputError(msg)
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--prompts: {path} cannot be read as UTF-8 text ({type(error).__name__}: {error})") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as error:
                raise InputError(f"{path}:{number}: not a JSON object ({type(error).__name__}: {str(error)[:120]})") from error
            prompts.append(_prompt(f"{path}:{number}", row, tokenizer, len(prompts)))
        if limit is not None and len(prompts) == limit:
            break
    return prompts


def _prompt(where: str, row: dict, tokenizer, index: int) -> Prompt:
    if not isinstance(row, dict) or ("prompt" in row) == ("tokens" in row):
        msg = f"{where}: each line must be an object with exactly one of 'prompt' (text) or 'tokens' (ids)"
        raise InputError(msg)
    if "prompt" in row and tokenizer is None:
        msg = f"{where}: a text prompt needs a tokenizer: pass --tokenizer DIR (the target checkpoint)"
        raise TokenizerError(msg)
    tokens = tokenizer.encode(row["prompt"]) if "prompt" in row else row["tokens"]
    if not isinstance(tokens, list):
        raise InputError(f"{where}: 'tokens' must be a list of token ids, got {type(tokens).__name__}")
    return Prompt(str(row.get("name", index)), tokens, row.get("max_new_tokens"))


def fit_prompt(tokens: list[int], max_context: int, room: int) -> list[int]:
    """Keep the last tokens of a prompt so that ``room`` new tokens still fit the context."""
    return tokens[-max(1, max_context - room) :]


# ---------------------------------------------------------------------- serving


def serve(executor: Executor, prompts: list[Prompt], args, stop: tuple[int, ...]) -> tuple[list[Completion], float]:
    """Every prompt through ``generate.stream``; (completions, wall seconds)."""
    requests = [
        Request(p.tokens, p.max_new_tokens or args.max_new_tokens, stop, args.temperature, args.top_k, args.top_p, args.seed + i)
        for i, p in enumerate(prompts)
    ]
    started = time.perf_counter()
    completions = collect(stream(executor, requests, args.max_sessions), len(requests))
    return completions, time.perf_counter() - started


def summary(executor: Executor, completions: list[Completion], seconds: float) -> dict:
    """Headline figures of a run.

    tokens/s over the wall time of serving; τ over speculative cycles (bonus
    included); ``ms_per_call``: wall ms per device launch of the decode loop
    (a cycle, or a plain decode step); ``host_overhead_fraction``: (wall −
    device busy) / wall, device busy = every timed call (prefill and loop);
    ``gpu_idle_fraction``: the device's idle share between consecutive
    launches of one execute (CUDA; 0 on CPU, where launches are synchronous).
    """
    import polars as pl

    cycles = executor.cycle_stats()
    speculative = cycles.filter(pl.col("mode") != TARGET)
    tokens = sum(len(c.tokens) for c in completions)
    tau = speculative["emitted"].mean() if speculative.height else None
    per_call = cycles.group_by("cycle_id").agg(pl.col("draft_ms", "verify_ms", "host_ms").first())
    host_ms = per_call["host_ms"].mean() if per_call.height else None
    busy_s = float((per_call["draft_ms"] + per_call["verify_ms"]).sum()) / 1000 if per_call.height else 0.0
    timeline = executor.loop.timeline
    launches = timeline.launches
    loop_ms = timeline.busy_ms + timeline.idle_ms
    return {
        "prompts": len(completions),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
        "tau": round(tau, 3) if tau is not None else None,
        "cycles": speculative["cycle_id"].n_unique(),
        "host_ms_per_cycle": round(host_ms, 3) if host_ms is not None else None,
        "ms_per_call": round(seconds * 1000 / launches, 4) if launches else None,
        "device_s": round(busy_s, 4),
        "host_overhead_fraction": round(max(0.0, 1 - busy_s / seconds), 4) if seconds > 0 else None,
        "gpu_idle_fraction": round(timeline.idle_ms / loop_ms, 4) if loop_ms > 0 else None,
    }


def write_outputs(out: Path, prompts: list[Prompt], completions: list[Completion], tokenizer) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "outputs.jsonl"
    with path.open("w") as file:
        for index, (p, c) in enumerate(zip(prompts, completions)):
            text = tokenizer.decode(c.tokens) if tokenizer is not None else None
            row = {"index": index, "name": p.name, "prompt_tokens": len(p.tokens), "prompt_ids": list(p.tokens),
                   "tokens": c.tokens, "text": text, "finish": c.finish}
            file.write(json.dumps(row) + "\n")
    return path


def run(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer, args.artifacts, args.target)
    with OPENERS[args.backend](args) as backend, make_executor(backend, args, not args.no_draft) as executor:
        stop = stop_tokens(args, tokenizer)
        prompts = load_prompts(args, tokenizer, executor.dims.max_context)
        completions, seconds = serve(executor, prompts, args, stop)
        outputs = write_outputs(args.out, prompts, completions, tokenizer)
        cycles, executes = executor.write_stats(args.out / "stats")
        print(f"wrote {outputs}, {cycles}, {executes}")
        print(json.dumps(summary(executor, completions, seconds)))
    return 0


def make_executor(backend, args, speculate: bool) -> Executor:
    """A finite job's executor: every stats row kept."""
    return Executor(backend, max_sessions=args.max_sessions, stats_rows=None, speculate=speculate, max_cycles=args.max_cycles)


def load_prompts(args, tokenizer, max_context: int) -> list[Prompt]:
    """The prompt file, each prompt cut to leave room for its new tokens."""
    room = args.max_new_tokens
    return [
        Prompt(p.name, fit_prompt(p.tokens, max_context, p.max_new_tokens or room), p.max_new_tokens)
        for p in read_prompts(args.prompts, tokenizer, args.limit)
    ]


def stop_tokens(args, tokenizer) -> tuple[int, ...]:
    """The tokenizer's stop ids, else the manifest's."""
    return tokenizer.stop_ids if tokenizer is not None else _manifest_stops(args.artifacts)


def _manifest_stops(directory: Path) -> tuple[int, ...]:
    from dflash_trt.export.manifest import load_manifest

    try:
        return tuple(load_manifest(directory, verify="none").special_tokens.stop)
    except Exception:  # an engine dir without an export manifest: no stop tokens
        return ()
