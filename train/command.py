"""``dflash-trt train {tokenizer,target,draft,prompts,eval,all}``.

- ``tokenizer``: byte-level BPE on the corpus → ``--out`` (tokenizer files).
- ``target``: a small Qwen3 trained from scratch with that tokenizer →
  ``--out`` (HF checkpoint + tokenizer), then its held-out loss.
- ``draft``: a DFlash draft for ANY target checkpoint ``--target`` (its own
  tokenizer.json encodes the corpus); only the draft trains. With
  ``--regenerate-s`` it trains on text the target writes from corpus prefixes;
  ``--init-draft`` warm-starts from an earlier draft (``--draft-layers`` above its count grows it: the new
  layers start as exact identities), ``--regen-seed`` gives a warm start new text.
- ``prompts``: code prompts cut from held-out files → a JSON-lines file.
- ``eval``: τ at each ``--temperature`` with the reference decoder (and,
  with ``--val-loss``, the target's held-out loss on the corpus).
- ``all``: every stage in one process under one wall-time deadline (one GPU
  call): ``--out``/target, ``--out``/draft, ``--out``/prompts.jsonl,
  ``--out``/summary.json.

The corpus defaults to the ``*.py`` files of this interpreter's site-packages.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from dflash_trt.errors import InputError, TokenizerError
from dflash_trt.export.config import read_json
from dflash_trt.export.draft import load_draft
from dflash_trt.export.target import load_target
from dflash_trt.train import evaluate
from dflash_trt.train.corpus import Corpus, Limits, load_corpus
from dflash_trt.train.draft import DraftShape, DraftTraining, grown_state, train_draft
from dflash_trt.train.loop import TokenStream
from dflash_trt.train.regenerate import SequenceBank, regenerate
from dflash_trt.train.target import TargetShape, TargetTraining, train_target
from dflash_trt.train.tokenizer import (
    MASK,
    encode_documents,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    stages = parser.add_subparsers(dest="stage", metavar="STAGE", required=True)
    for name, (help_text, add, run_stage) in STAGES.items():
        sub = stages.add_parser(name, help=help_text, description=help_text)
        add(sub)
        sub.set_defaults(_stage=run_stage)


def run(args: argparse.Namespace) -> int:
    return int(args._stage(args) or 0)



# ---- arguments -------------------------------------------------------------


def _corpus_args(parser: argparse.ArgumentParser, required: bool = False) -> None:
    group = parser.add_argument_group("corpus")
    group.add_argument("--corpus", nargs="+", required=required, metavar="SRC",
                       help="folders or globs (default: this interpreter's site-packages)")
    group.add_argument("--pattern", default="*.py", help="file pattern inside corpus folders (default *.py)")
    group.add_argument("--val-fraction", type=float, default=0.02, help="share of files held out (by name hash)")
    group.add_argument("--max-chars", type=int, default=Limits.max_total_chars, help="cap on corpus characters")


def _run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (default)")
    parser.add_argument("--log", type=Path, help="append JSON-lines training records here")


def _target_shape_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target shape and training")
    defaults, training = TargetShape(), TargetTraining()
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "context"):
        group.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(defaults, field))
    group.add_argument("--vocab-size", type=int, default=8192)
    group.add_argument("--target-batch-size", type=int, default=training.batch_size)
    group.add_argument("--target-lr", type=float, default=training.lr)
    group.add_argument("--target-steps", type=int, default=training.max_steps, help="max steps")
    group.add_argument("--target-budget-s", type=float, default=training.time_budget_s, help="wall-time budget")


def _draft_shape_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("draft shape and training")
    shape, training = DraftShape(), DraftTraining()
    group.add_argument("--block-size", type=int, default=shape.block_size)
    group.add_argument("--draft-layers", type=int, help=f"default {shape.num_layers}; with --init-draft: grow it to "
                       "this many layers (the new ones start as exact identities)")
    group.add_argument("--taps", type=int, default=shape.num_taps, help="tap count (default ids per docs/design.md §1)")
    group.add_argument("--tap-layers", type=lambda s: tuple(int(x) for x in s.split(",")), default=(),
                       help="explicit target layer ids, e.g. 1,3,5")
    group.add_argument("--mask-token-id", type=int, help=f"default: the target tokenizer's {MASK}")
    group.add_argument("--no-init-from-target", action="store_true", help="random draft layers")
    group.add_argument("--draft-batch-size", type=int, default=training.batch_size)
    group.add_argument("--seq-len", type=int, default=training.seq_len, help="draft training sequence length")
    group.add_argument("--anchors", type=int, default=training.anchors, help="blocks per sequence")
    group.add_argument("--gamma", type=float, default=training.gamma, help="slot-weight decay (0: 7 for B>=16, else 4)")
    group.add_argument("--draft-lr", type=float, default=training.lr)
    group.add_argument("--draft-steps", type=int, default=training.max_steps, help="max steps")
    group.add_argument("--draft-budget-s", type=float, default=training.time_budget_s, help="wall-time budget")
    group.add_argument("--init-draft", type=Path, help="warm-start from this draft checkpoint (its shape wins, "
                       "but for --draft-layers)")
    regen = parser.add_argument_group("target-regenerated data (see train/regenerate.py)")
    regen.add_argument("--regenerate-s", type=float, default=0.0,
                       help="seconds spent having the target continue corpus prefixes; 0: train on the corpus")
    regen.add_argument("--regen-prefix", type=int, default=256, help="real corpus tokens per sequence")
    regen.add_argument("--regen-length", type=int, default=640, help="sequence length (prefix + generated)")
    regen.add_argument("--regen-seed", type=int, default=12345,
                       help="seed of the prefixes drawn and the sampled continuations: warm-starting a draft again, "
                       "a new seed gives it new text (the same seed repeats the earlier rows)")
    regen.add_argument("--greedy-share", type=float, default=0.75, help="rows continued greedily (rest: T=1)")
    regen.add_argument("--regen-rows", type=int, default=2048, help="rows decoded together")


def _args_tokenizer(parser):
    _corpus_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="folder for tokenizer.json + tokenizer_config.json")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer-chars", type=int, default=50_000_000, help="train on at most this many chars")
    parser.add_argument("--context", type=int, default=TargetShape.context, help="model_max_length")


def _args_target(parser):
    _corpus_args(parser)
    _run_args(parser)
    _target_shape_args(parser)
    parser.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: --out)")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")


def _args_draft(parser):
    _corpus_args(parser)
    _run_args(parser)
    _draft_shape_args(parser)
    parser.add_argument("--target", type=Path, required=True, help="target checkpoint folder (with tokenizer.json)")
    parser.add_argument("--out", type=Path, required=True, help="draft checkpoint folder to write")


def _args_prompts(parser):
    _corpus_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file to write")
    parser.add_argument("--count", type=int, default=64)


def _args_eval(parser):
    _corpus_args(parser)
    parser.add_argument("--device", default="cpu", help="device of the held-out loss (tau runs on CPU)")
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="JSON lines with a 'prompt' field")
    parser.add_argument("--count", type=int, default=50, help="prompts used (the first COUNT)")
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--check-lossless", type=int, default=5, help="prompts also decoded target-only")
    parser.add_argument("--json", type=Path, help="append one JSON object per measurement here")
    parser.add_argument("--val-loss", action="store_true", help="also score the target on held-out corpus files")
    parser.add_argument("--val-tokens", type=int, default=2_000_000, help="held-out tokens scored")


def _args_all(parser):
    _corpus_args(parser)
    _run_args(parser)
    _target_shape_args(parser)
    _draft_shape_args(parser)
    parser.add_argument("--out", type=Path, required=True, help="root folder: target/, draft/, prompts.jsonl")
    parser.add_argument("--tokenizer-chars", type=int, default=50_000_000)
    parser.add_argument("--prompt-count", type=int, default=64)
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="total wall-time budget; > 0 overrides the stage budgets (split by --target-share)")
    parser.add_argument("--target-share", type=float, default=0.6)
    parser.add_argument("--reserve-s", type=float, default=45.0, help="kept for evaluation and saving")


# ---- stages ----------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _load_corpus(args) -> Corpus:
    start = time.perf_counter()
    corpus = load_corpus(args.corpus, args.pattern, args.val_fraction, Limits(max_total_chars=args.max_chars))
    print(f"corpus: {corpus.describe()} in {time.perf_counter() - start:.1f} s", flush=True)
    return corpus


def _tokenizer_sample(corpus: Corpus, chars: int) -> list[str]:
    texts, total = [], 0
    for document in corpus.train:  # sorted by name: a deterministic prefix of packages
        texts.append(document.text)
        total += len(document.text)
        if total >= chars:
            break
    return texts


def _streams(tokenizer, eos, corpus: Corpus, device) -> tuple[TokenStream, TokenStream]:
    start = time.perf_counter()
    train = encode_documents(tokenizer, [d.text for d in corpus.train], eos)
    val = encode_documents(tokenizer, [d.text for d in corpus.val], eos)
    print(f"encoded: {len(train)} train / {len(val)} held-out tokens in {time.perf_counter() - start:.1f} s",
          flush=True)
    return TokenStream(train, device), TokenStream(val, device)


def _make_tokenizer(args, corpus: Corpus, out: Path):
    start = time.perf_counter()
    tokenizer = train_tokenizer(_tokenizer_sample(corpus, args.tokenizer_chars), args.vocab_size)
    save_tokenizer(tokenizer, out, max_length=args.context)
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - start:.1f} s -> {out}",
          flush=True)
    return tokenizer


def _run_tokenizer(args) -> int:
    _make_tokenizer(args, _load_corpus(args), args.out)
    return 0


def _target_settings(args, budget_s: float | None = None) -> tuple[TargetShape, TargetTraining]:
    shape = TargetShape(args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim,
                        args.intermediate_size, args.context)
    training = TargetTraining(batch_size=args.target_batch_size, lr=args.target_lr, max_steps=args.target_steps,
                              time_budget_s=budget_s or args.target_budget_s)
    return shape, training


def _fit_target(args, tokenizer, streams, device, budget_s: float | None = None) -> dict:
    shape, training = _target_settings(args, budget_s)
    _, record = train_target(tokenizer, streams[0], args.out_target, shape, training, args.log)
    shipped = load_target(args.out_target, dtype=torch.bfloat16).to(device)
    record.update(evaluate.held_out_loss(shipped, streams[1], shape.context))
    _report(args.log, {"stage": "target", "result": record})
    return record


def _run_target(args) -> int:
    device = _device(args.device)
    tokenizer = load_tokenizer(args.tokenizer or args.out)
    corpus = _load_corpus(args)
    streams = _streams(tokenizer, special_ids(tokenizer)["eos"], corpus, device)
    args.out_target = args.out
    _fit_target(args, tokenizer, streams, device)
    return 0


def _mask_token(args, tokenizer) -> int:
    if args.mask_token_id is not None:
        return args.mask_token_id
    mask = tokenizer.token_to_id(MASK)
    if mask is None:
        raise TokenizerError(
            f"the target's tokenizer has no {MASK} token: pass --mask-token-id (a real embedding row the "
            "target never needs to emit, e.g. a reserved special token)"
        )
    return mask


def _draft_settings(args, context: int, budget_s: float | None = None) -> tuple[DraftShape, DraftTraining]:
    layers = DraftShape.num_layers if args.draft_layers is None else args.draft_layers
    shape = DraftShape(layers, args.block_size, args.taps, args.tap_layers, init_from_target=not args.no_init_from_target)
    training = DraftTraining(batch_size=args.draft_batch_size, seq_len=min(args.seq_len, context),
                             anchors=args.anchors, gamma=args.gamma, lr=args.draft_lr, max_steps=args.draft_steps,
                             time_budget_s=budget_s or args.draft_budget_s)
    return shape, training


def _fit_draft(args, target_dir: Path, out: Path, tokenizer, stream, device, budget_s=None) -> dict:
    target = load_target(target_dir, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).to(device)
    context = target.config.max_position_embeddings
    shape, training = _draft_settings(args, context, budget_s)
    mask, init_state = _mask_token(args, tokenizer), None
    if args.init_draft:
        shape, mask, init_state = _warm_start(args.init_draft, shape, args.draft_layers)
    if args.regenerate_s > 0:
        stream = _regenerated(args, target, stream)
        training = replace(training, seq_len=args.regen_length)
    raw = read_json(target_dir / "config.json")
    _, record = train_draft(target, raw, stream, out, mask, shape, training, args.log, init_state)
    _report(args.log, {"stage": "draft", "result": record})
    return record


def _warm_start(directory: Path, shape: DraftShape, layers: int | None) -> tuple[DraftShape, int, dict]:
    """The earlier draft's shape, mask token and tensors; grown to ``layers`` (``grown_state``) if given."""
    earlier = load_draft(directory)
    config = earlier.config
    layers = config.num_layers if layers is None else layers
    if layers < config.num_layers:
        raise InputError(f"--draft-layers must be >= the --init-draft's {config.num_layers} layers (a draft grows, "
                         f"never shrinks), got {layers}")
    shape = replace(shape, num_layers=layers, block_size=config.block_size,
                    tap_layers=tuple(config.target_layer_ids), intermediate_size=config.intermediate_size,
                    init_from_target=False)
    return shape, config.mask_token_id, grown_state(earlier.state_dict(), layers)


def _regenerated(args, target, stream: TokenStream) -> SequenceBank:
    start = time.perf_counter()
    generator = torch.Generator(device=stream.device).manual_seed(args.regen_seed)
    bank = regenerate(target, stream, args.regen_prefix, args.regen_length, args.greedy_share, generator,
                      args.regenerate_s, args.regen_rows)
    seconds = time.perf_counter() - start
    _report(args.log, {"stage": "regenerate", "rows": bank.rows.shape[0], "length": bank.rows.shape[1],
                       "greedy_share": args.greedy_share, "wall_s": round(seconds, 1)})
    print(f"regenerated {tuple(bank.rows.shape)} in {seconds:.1f} s", flush=True)
    return bank


def _target_eos(target_dir: Path, tokenizer) -> int | None:
    config = read_json(target_dir / "config.json")
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) else None


def _run_draft(args) -> int:
    device = _device(args.device)
    tokenizer = load_tokenizer(args.target)
    corpus = _load_corpus(args)
    train, _ = _streams(tokenizer, _target_eos(args.target, tokenizer), corpus, device)
    _fit_draft(args, args.target, args.out, tokenizer, train, device)
    return 0


def _run_prompts(args) -> int:
    prompts = evaluate.cut_prompts(_load_corpus(args).val, args.count)
    if len(prompts) < args.count:
        raise InputError(f"only {len(prompts)} held-out files give a prompt, asked for {args.count}")
    evaluate.write_prompts(prompts, args.out)
    print(f"{len(prompts)} prompts -> {args.out}")
    return 0


def _run_eval(args) -> int:
    torch.set_grad_enabled(False)
    draft = load_draft(args.draft)
    target = load_target(args.target, tap_layers=draft.config.target_layer_ids)
    tokenizer = load_tokenizer(args.target)
    prompts = evaluate.read_prompts(args.prompts)[: args.count]
    results = []
    for temperature in args.temperature:
        check = args.check_lossless
        results.append(evaluate.measure_tau(target, draft, tokenizer, prompts, temperature, args.max_new_tokens, check))
    if args.val_loss:
        device = _device(args.device)
        documents = [d.text for d in _load_corpus(args).val]
        val = TokenStream(encode_documents(tokenizer, documents, _target_eos(args.target, tokenizer)), device)
        context = target.config.max_position_embeddings
        results.append(evaluate.held_out_loss(target.to(device), val, context, args.val_tokens))
    for result in results:
        print(json.dumps(result))
        _report(args.json, result)
    failed = sum(r.get("lossless_mismatches", 0) for r in results)
    if failed:
        print(f"LOSSLESSNESS VIOLATED: {failed} prompt(s) differ from target-only decoding")
    return 1 if failed else 0


def _run_all(args) -> int:
    start, device = time.perf_counter(), _device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    args.out_target, draft_dir = args.out / "target", args.out / "draft"
    corpus = _load_corpus(args)
    tokenizer = _make_tokenizer(args, corpus, args.out_target)
    streams = _streams(tokenizer, special_ids(tokenizer)["eos"], corpus, device)
    target_budget = draft_budget = None
    if args.deadline_s > 0:
        left = args.deadline_s - (time.perf_counter() - start) - args.reserve_s
        target_budget = max(10.0, left * args.target_share)
        draft_budget = max(10.0, left - target_budget)
    summary = {"target": _fit_target(args, tokenizer, streams, device, target_budget)}
    if args.deadline_s > 0:  # whatever the target stage left unused (or overran) moves to the draft
        draft_budget = max(10.0, args.deadline_s - args.reserve_s - (time.perf_counter() - start))
    summary["draft"] = _fit_draft(args, args.out_target, draft_dir, tokenizer, streams[0], device, draft_budget)
    evaluate.write_prompts(evaluate.cut_prompts(corpus.val, args.prompt_count), args.out / "prompts.jsonl")
    summary["corpus"] = corpus.describe()
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    summary["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


def _report(path: Path | None, record: dict) -> None:
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")


# stage -> (one-line help, add its arguments, run it)
STAGES = {
    "tokenizer": ("train a byte-level BPE tokenizer on the corpus", _args_tokenizer, _run_tokenizer),
    "target": ("train a small Qwen3 target from scratch (needs a tokenizer)", _args_target, _run_target),
    "draft": ("train a DFlash draft for a target checkpoint (the target stays frozen)", _args_draft, _run_draft),
    "prompts": ("cut code prompts from held-out corpus files", _args_prompts, _run_prompts),
    "eval": ("tau of a draft at given temperatures (reference decoder); held-out loss of the target", _args_eval, _run_eval),
    "all": ("tokenizer + target + draft + prompts in one process, under one wall-time deadline", _args_all, _run_all),
}


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash_trt.train.command STAGE ...``: the same stages without the
    top-level CLI (which imports every stage's command module)."""
    parser = argparse.ArgumentParser(prog="dflash-trt train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
