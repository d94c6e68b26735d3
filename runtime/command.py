"""``dflash-trt run``: serve a prompt file through the runtime; write outputs (JSONL) and stats (Parquet).

    dflash-trt run --out run/                      # the embedded default pair: exported to the cache, ONNX Runtime (CPU)
    dflash-trt run --artifacts EXPORT_DIR --backend onnxruntime --prompts prompts.jsonl --out run/
    dflash-trt run --backend torch --device cuda --out run/        # the checkpoints in PyTorch, no export
    dflash-trt run ... --no-draft        # the same prompts, plain target decoding (the baseline)

Backends and artifacts: ``onnxruntime`` runs an export dir (``--artifacts``;
without it, ``--target``/``--draft`` — the embedded pair by default — are
exported to ``--cache`` in fp32 once, as ``dflash-trt demo`` does);
``torch`` runs the checkpoints themselves (``--target``/``--draft``, the
embedded pair by default; ``--dtype``, default bf16 on CUDA and fp32 on CPU;
``--max-owners``), or with ``--artifacts`` the geometry of that export;
``tensorrt`` runs an engine dir (``--artifacts``, required). Flags that
cannot work together, and an export the backend's device cannot run (bf16
on ONNX Runtime's CPU provider), are refused before anything loads
(``UsageError``, exit code 2).

Prompt file (default: the embedded pair's 64 held-out code prompts): one
JSON object per line with ``prompt`` (text; needs a tokenizer) or
``tokens`` (ids), and optionally ``name`` and ``max_new_tokens``. The
tokenizer is the first ``tokenizer.json`` among ``--tokenizer``, the
artifacts dir (an export holds its target's) and ``--target``; stop tokens
are its eos ids, else the manifest's.

Writes ``OUT/outputs.jsonl`` (per prompt: index, name, prompt_tokens, prompt_ids, tokens,
text, finish) and ``OUT/stats.parquet`` + ``OUT/stats.executes.parquet``
(``runtime.stats``), then prints one summary line (``summary``): the same
figures ``dflash-trt report OUT/stats.parquet`` computes from those files.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_trt.cli import check_sampling_flags, nonnegative_int, positive_int
from dflash_trt.errors import InputError, TokenizerError, UsageError
from dflash_trt.export import DEFAULT_PAIR_DIR
from dflash_trt.export.contract import DTYPES
from dflash_trt.export.sampling_params import Sampling
from dflash_trt.export.tokenizer import load_tokenizer  # the commands' tokenizer (demo, bench: command.load_tokenizer)
from dflash_trt.runtime.limits import DEFAULT_MAX_CYCLES, MAX_LAG, MAX_LAUNCH_ROUNDS, SERVE_CUDA_LAUNCH_ROUNDS  # noqa: F401  (for serve's flags)
from dflash_trt.runtime.serving.handle import Completion

if TYPE_CHECKING:  # the engine loads where a command runs it, not where its flags are built (serve's first front)
    from dflash_trt.runtime.executor import Executor

BACKEND_CHOICES = ("onnxruntime", "torch", "tensorrt")
KERNEL_CHOICES = ("auto", "fast", "exact", "eager")  # the torch backend's kernels= (torch_backend.KERNELS; not imported here: torch loads late)
DRAFT_WEIGHTS = ("model", "fp8")  # the torch backend's draft_weights= (kernels.quant.DRAFT_WEIGHTS; not imported here, as above)


def default_cache_dir() -> Path:
    """The user's dflash-trt cache (``export.identity.default_cache_dir``), imported lazily."""
    from dflash_trt.export import identity

    return identity.default_cache_dir()


def add_arguments(parser: argparse.ArgumentParser, out_required: bool = True) -> None:
    """``out_required``: --out must be given (``bench --serve`` writes nothing unless asked)."""
    pair = DEFAULT_PAIR_DIR
    parser.add_argument("--artifacts", type=Path, help="export dir (manifest.json + ONNX), or engine dir for tensorrt; default: "
                        "--target/--draft exported to --cache (onnxruntime) or run as checkpoints (torch)")
    parser.add_argument("--backend", choices=BACKEND_CHOICES, default="onnxruntime")
    parser.add_argument("--prompts", type=Path, default=pair / "prompts.jsonl",
                        help="JSONL: {prompt | tokens, name?, max_new_tokens?} per line (default: the embedded pair's held-out prompts)")
    parser.add_argument("--out", type=Path, required=out_required, help="output dir: outputs.jsonl, stats.parquet, stats.executes.parquet")
    add_generation_arguments(parser)
    add_checkpoint_arguments(parser)
    parser.add_argument("--tokenizer", type=Path, help="dir with tokenizer.json (default: --artifacts, then --target)")
    parser.add_argument("--limit", type=positive_int, help="serve only the first N prompts")
    parser.add_argument("--no-draft", action="store_true", help="plain target decoding (no speculation): the baseline")
    add_policy_argument(parser)


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared with ``dflash-trt demo``."""
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=nonnegative_int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="prompt i samples with seed + i")
    parser.add_argument("--max-sessions", type=positive_int, help="sessions at once (default: the artifacts' max_sessions)")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for ONNX Runtime / torch")
    parser.add_argument("--max-cycles", type=positive_int, default=DEFAULT_MAX_CYCLES,
                        help=f"cycles per session per execute call (default {DEFAULT_MAX_CYCLES})")


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    """``--policy`` (shared with ``dflash-trt serve``): how drafting sessions choose cycles (``runtime.policy``)."""
    from dflash_trt.runtime.policy import POLICIES

    parser.add_argument("--policy", choices=POLICIES, default="adaptive",
                        help="speculation policy: adaptive (per round a cycle or a plain decode step, from measured costs and acceptance; "
                             "default), always (cycle whenever a block fits), or adaptive-stop (adaptive; where cycling loses by estimate, "
                             "a session stops drafting for good instead of its next drain cycle; gained nothing on the H200); "
                             "--no-draft stays plain decoding")


def add_checkpoint_arguments(parser: argparse.ArgumentParser, target_default: Path | None = None) -> None:
    """Where the models come from without ``--artifacts`` (shared with ``dflash-trt serve``)."""
    parser.add_argument("--target", type=Path, default=target_default,
                        help="target checkpoint (default without --artifacts: the embedded pair; tokenizer fallback)")
    parser.add_argument("--draft", type=Path, default=target_default and target_default.parent / "draft",
                        help="draft checkpoint (default without --artifacts: the embedded pair)")
    parser.add_argument("--cache", type=Path, default=default_cache_dir(), help="export cache (default ~/.cache/dflash-trt or $DFLASH_TRT_CACHE)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cpu, cuda for tensorrt)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="torch backend without --artifacts: weights and caches (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--max-owners", type=positive_int, help="torch backend without --artifacts: sessions per draft/verify launch (default: --max-sessions)")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                        help="torch backend: auto (exact in bf16 on CUDA, fast in other dtypes, eager on the CPU), exact (CUDA: "
                             "rows that do not depend on the batch, so bf16 DFlash output equals plain decoding), fast (CUDA: "
                             "~15%% more throughput at 16 sessions, bf16 output may differ with the batch), eager")
    parser.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default="model",
                        help="torch backend: the draft's weights in the model's dtype (default) or fp8 with a scale per row (half the "
                             "bytes a draft launch streams; the output is unchanged, the acceptance a little lower: exact kernels on "
                             "CUDA, the CPU twin with --kernels fast)")


# ---------------------------------------------------------------------- backends


def check_flags(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, flags that cannot work together (``UsageError``, exit code 2).

    Fills in the embedded pair as ``--target``/``--draft`` when neither
    ``--artifacts`` nor they were given.
    """
    if getattr(args, "temperature", None) is not None:
        check_sampling_flags(args)
    checkpoints = args.backend == "torch" and args.artifacts is None
    kernels = getattr(args, "kernels", "auto")
    if kernels != "auto" and args.backend != "torch":
        raise UsageError(f"--kernels {kernels} applies to --backend torch (got --backend {args.backend})")
    if kernels == "exact" and not (args.device or "cpu").startswith("cuda"):
        raise UsageError(f"--kernels exact runs Triton kernels on a CUDA device: add --device cuda (got --device {args.device or 'cpu'})")
    if getattr(args, "draft_weights", "model") != "model" and args.backend != "torch":
        raise UsageError(f"--draft-weights {args.draft_weights} applies to --backend torch (got --backend {args.backend})")
    if (args.dtype is not None or args.max_owners is not None) and not checkpoints:
        raise UsageError("--dtype and --max-owners apply to --backend torch without --artifacts (an artifact set fixes both)")
    if args.backend == "tensorrt" and args.artifacts is None:
        raise UsageError("--backend tensorrt needs --artifacts ENGINE_DIR (made by dflash-trt build)")
    if args.backend == "torch" and args.artifacts is not None and (args.target is None or args.draft is None):
        raise UsageError("--backend torch with --artifacts needs --target and --draft (checkpoint dirs; the artifacts give the dims)")
    if args.artifacts is None:
        pair = DEFAULT_PAIR_DIR
        args.target, args.draft = args.target or pair / "target", args.draft or pair / "draft"
    elif args.backend == "onnxruntime":
        check_runnable_export(args.artifacts, args.device or "cpu")


def check_runnable_export(directory: Path, device: str) -> None:
    """An export whose dtype ONNX Runtime cannot run on ``device`` is a usage error, named before loading."""
    from dflash_trt.errors import EngineError
    from dflash_trt.export.manifest import load_manifest
    from dflash_trt.runtime.backends.ort_backend import check_dtype

    manifest = load_manifest(directory, verify="none")
    try:
        check_dtype(DTYPES[manifest.dtype], device)
    except EngineError as error:
        raise UsageError(f"--artifacts {directory}: {error}") from None


def prepare_artifacts(args: argparse.Namespace) -> None:
    """Without ``--artifacts`` on ONNX Runtime: ``--target``/``--draft`` exported to ``--cache`` (fp32; kept while unchanged)."""
    if args.artifacts is None and args.backend == "onnxruntime":
        from dflash_trt import demo

        args.artifacts = demo.export_dir(args)


def open_backend(args: argparse.Namespace):
    """The backend the (checked, prepared) flags name; torch without ``--artifacts`` runs the checkpoints."""
    if args.artifacts is None:
        return torch_from_checkpoints(args)
    return OPENERS[args.backend](args)


def torch_from_checkpoints(args: argparse.Namespace):
    """TorchBackend over ``--target``/``--draft`` with the export's default geometry (``ExportOptions``), sized for
    ``--max-sessions`` (default 16): no export needed."""
    import torch

    from dflash_trt.export.exporter import ExportOptions, contract_dims
    from dflash_trt.export.pair import load_pair
    from dflash_trt.runtime.backends import TorchBackend
    from dflash_trt.runtime.backends.graph_io import torch_dtype

    device = args.device or "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    args.max_sessions = args.max_sessions or CHECKPOINT_SESSIONS
    dtype = args.dtype or ("fp32" if device == "cpu" else "bf16")
    owners = min(args.max_owners or args.max_sessions, args.max_sessions)
    options = ExportOptions(max_owners=owners, max_sessions=args.max_sessions, dtype=dtype).resolve(args.target, args.draft)
    target, draft = load_pair(args.target, args.draft, dtype=torch_dtype(DTYPES[dtype]))
    return TorchBackend(target, draft, contract_dims(target, draft, options), args.max_sessions, device=device,
                        kernels=getattr(args, "kernels", "auto"), draft_weights=getattr(args, "draft_weights", "model"))


CHECKPOINT_SESSIONS = 16  # cache rows of a torch backend run from checkpoints when --max-sessions is not given


def _open_onnxruntime(args):
    return open_onnxruntime(args.artifacts, args.max_sessions, args.threads, args.device or "cpu")


def open_onnxruntime(artifacts: Path, max_sessions: int | None, threads: int | None, device: str = "cpu"):
    """The CLI's ONNX Runtime backend (``run``, ``bench``, ``serve``, ``demo``): torch at one thread while it is
    open, since on the CPU torch only glues ONNX Runtime's runs together (``OrtBackend``'s docstring)."""
    from dflash_trt.runtime.backends import OrtBackend

    return OrtBackend.from_export(artifacts, max_sessions=max_sessions, device=device, threads=threads, torch_threads=1)


def _open_torch(args):
    import torch

    from dflash_trt.runtime.backends import TorchBackend

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or "cpu"
    return TorchBackend.from_checkpoints(args.target, args.draft, args.artifacts, max_sessions=args.max_sessions, device=device,
                                         kernels=getattr(args, "kernels", "auto"), draft_weights=getattr(args, "draft_weights", "model"))


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


def serve(executor: Executor, prompts: list[Prompt], args, stop: tuple[int, ...]) -> list[Completion]:
    """Every prompt through ``generate.stream`` (its time is in the stats: ``summary``)."""
    from dflash_trt.runtime.generate import collect, stream
    from dflash_trt.runtime.serving.batcher import Request

    requests = [
        Request(p.tokens, p.max_new_tokens or args.max_new_tokens, stop, Sampling(args.temperature, args.top_k, args.top_p, args.seed + i))
        for i, p in enumerate(prompts)
    ]
    return collect(stream(executor, requests, args.max_sessions), len(requests))


def summary(executor: Executor, completions: list[Completion]) -> dict:
    """Headline figures of a run, from its stats with the report's definitions (``analysis.compare.run_summary``).

    ``mode``: ``dflash`` or ``plain`` (no speculative cycle); ``tokens``:
    tokens callers received; ``seconds``: the run's span, first execute start
    to last execute end; ``tokens_per_s``: tokens / seconds; ``tau``: mean
    accepted + 1 over speculative owner-cycles (None for plain decoding);
    ``cycles``: those owner-cycles; ``calls``: device calls (prefills, cycles,
    decode steps); ``device_s``: their device time; ``host_ms_per_call``: mean
    host time between calls; ``ms_per_launch``: wall ms per launch of the
    decode loop (a cycle, or a plain decode step); ``host_overhead_fraction``:
    (wall − device) / wall; ``gpu_idle_fraction``: the device's idle share
    between consecutive launches of one execute (CUDA; 0 on CPU, where
    launches are synchronous). ``dflash-trt report`` on the written stats
    prints the same tokens, seconds, tokens/s, τ, cycles and calls.
    """
    from dflash_trt.analysis.throughput import latency_breakdown

    overview = run_overview(executor)
    phases = latency_breakdown(executor.cycle_stats().lazy()).collect()
    host = dict(zip(phases["phase"], phases["mean_ms"]))["host_ms"]
    seconds, device_s = overview["wall_s"] or 0.0, overview["device_s"] or 0.0
    timeline = executor.loop.timeline
    loop_ms = timeline.busy_ms + timeline.idle_ms
    return {
        "mode": overview["name"],
        "prompts": len(completions),
        "tokens": overview["tokens"],
        "seconds": round(seconds, 3),
        "tokens_per_s": rounded(overview["tokens_per_s"], 2),
        "tau": rounded(overview["tau"], 3),
        "cycles": overview["cycles"],
        "calls": overview["calls"],
        "device_s": round(device_s, 3),
        "host_ms_per_call": rounded(host, 3),
        "ms_per_launch": round(seconds * 1000 / timeline.launches, 3) if timeline.launches else None,
        "host_overhead_fraction": round(max(0.0, 1 - device_s / seconds), 3) if seconds > 0 else None,
        "gpu_idle_fraction": round(timeline.idle_ms / loop_ms, 3) if loop_ms > 0 else None,
    }


def run_overview(executor: Executor) -> dict:
    """``analysis.compare.run_summary`` of the executor's stats in memory (unrounded), named by mode."""
    from dflash_trt.analysis.compare import run_summary
    from dflash_trt.analysis.load import Run, mode_name

    cycles, executes = executor.cycle_stats().lazy(), executor.execute_stats().lazy()
    return run_summary(Run(mode_name(cycles), cycles, executes)).collect().row(0, named=True)


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


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
    check_flags(args)
    prepare_artifacts(args)
    tokenizer = load_tokenizer(args.tokenizer, args.artifacts, args.target)
    stop = stop_tokens(args, tokenizer)
    prompts = read_prompts(args.prompts, tokenizer, args.limit)  # a bad file fails before anything loads
    with open_backend(args) as backend, make_executor(backend, args, not args.no_draft) as executor:
        prompts = fit_prompts(prompts, args.max_new_tokens, executor.dims.max_context)
        completions = serve(executor, prompts, args, stop)
        outputs = write_outputs(args.out, prompts, completions, tokenizer)
        cycles, executes = executor.write_stats(args.out / "stats")
        print(f"wrote {outputs}, {cycles}, {executes}")
        print(json.dumps(summary(executor, completions)))
    return 0


def make_executor(backend, args, speculate: bool) -> Executor:
    """A finite job's executor: every stats row kept."""
    from dflash_trt.runtime.executor import Executor

    return Executor(backend, max_sessions=args.max_sessions, stats_rows=None, speculate=speculate, max_cycles=args.max_cycles,
                    policy=getattr(args, "policy", "adaptive"))


def fit_prompts(prompts: list[Prompt], max_new_tokens: int, max_context: int) -> list[Prompt]:
    """Each prompt cut to leave room for its new tokens (its own ``max_new_tokens``, else the flag's)."""
    return [Prompt(p.name, fit_prompt(p.tokens, max_context, p.max_new_tokens or max_new_tokens), p.max_new_tokens) for p in prompts]


def stop_tokens(args, tokenizer) -> tuple[int, ...]:
    """The tokenizer's stop ids, else the manifest's."""
    return tokenizer.stop_ids if tokenizer is not None else manifest_stops(args.artifacts)


def manifest_stops(directory: Path | None) -> tuple[int, ...]:
    """The stop tokens an export's manifest records; none without a directory, or for one without a manifest (an engine dir)."""
    from dflash_trt.export.manifest import load_manifest

    if directory is None:
        return ()
    try:
        return tuple(load_manifest(directory, verify="none").special_tokens.stop)
    except Exception:  # an engine dir without an export manifest: no stop tokens
        return ()
