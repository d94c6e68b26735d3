"""``dflash-trt generate``: reference (PyTorch eager, batch 1) generation from checkpoints.

The oracle as a command: useful to check a checkpoint pair before exporting,
and to see τ for a prompt. Prints the completion, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from dflash_trt.cli import check_sampling_flags, nonnegative_int, positive_int
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.export.target import load_target
from dflash_trt.export.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target checkpoint directory (HF layout, with tokenizer.json)")
    parser.add_argument("--draft", help="DFlash draft checkpoint directory; omit for target-only decoding")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="new tokens, >= 1 (default 64)")
    parser.add_argument("--proposals", type=positive_int, default=None, help="proposals per cycle, 2..block-1 (default block-1)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=nonnegative_int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=nonnegative_int, default=0)


def run(args: argparse.Namespace) -> int:
    check_sampling_flags(args)
    tokenizer = Tokenizer.from_dir(args.target)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    prompt = tokenizer.encode(args.prompt)
    began = time.perf_counter()
    if args.draft:
        decoder = ReferenceDecoder(*load_pair(args.target, args.draft))
        out = decoder.generate_dflash(prompt, args.max_new_tokens, sampling, args.proposals, tokenizer.stop_ids)
    else:
        decoder = ReferenceDecoder(load_target(args.target))
        out = decoder.generate_target(prompt, args.max_new_tokens, sampling, tokenizer.stop_ids)
    seconds = time.perf_counter() - began
    print(args.prompt + tokenizer.decode(out.tokens))
    summary = {"tokens": len(out.tokens), "cycles": len(out.accepted), "tau": round(out.tau, 4),
               "tokens_per_s": round(len(out.tokens) / seconds, 2)}
    print(json.dumps(summary))
    return 0
