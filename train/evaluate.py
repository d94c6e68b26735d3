"""Evaluation: the target's held-out loss and the draft's τ with the reference decoder.

τ is the mean acceptance length, bonus included (``Generation.tau``), pooled
over every draft cycle of every prompt (``tau``); the mean of per-prompt τ is
reported beside it (``tau_prompt_mean``). Prompts are cut from held-out files
at line boundaries, so they end where a code completion would start.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from dflash_trt.export.draft import DraftModel
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.export.target import TargetModel
from dflash_trt.train.corpus import Document, name_hash
from dflash_trt.train.loop import TokenStream, autocast
from dflash_trt.train.target import lm_loss


@torch.no_grad()
def held_out_loss(
    model: TargetModel, stream: TokenStream, seq_len: int, limit_tokens: int = 2_000_000, batch: int = 32
) -> dict:
    """Mean next-token loss over consecutive held-out windows (nats/token) and its perplexity."""
    chunks = stream.chunks(seq_len, limit_tokens)
    if not chunks:
        raise ValueError(f"held-out stream holds {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    total, count = 0.0, 0
    for start in range(0, len(chunks), batch):
        tokens = torch.stack(chunks[start : start + batch])
        with autocast(stream.device, True):
            total += lm_loss(model, tokens).item() * tokens[:, 1:].numel()
        count += tokens[:, 1:].numel()
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(loss), "val_tokens": count}


def cut_prompts(documents: list[Document], count: int, seed: int = 0, max_chars: int = 1500) -> list[dict]:
    """``count`` prompts, at most one per file: text up to a random line boundary, ≤ ``max_chars``.

    A cut is taken before a non-blank line past the file's first 10 lines, so
    the completion continues real code rather than a license header.
    """
    rng = random.Random(seed)
    prompts = []
    for document in sorted(documents, key=lambda d: name_hash("prompt:" + d.name)):
        lines = document.text.splitlines(keepends=True)
        cuts = [i for i in range(10, len(lines) - 5) if lines[i].strip()]
        if not cuts:
            continue
        cut = rng.choice(cuts)
        head, size = [], 0
        for line in reversed(lines[:cut]):
            if size + len(line) > max_chars:
                break
            head.insert(0, line)
            size += len(line)
        if size >= 200:
            prompts.append({"name": document.name, "prompt": "".join(head)})
        if len(prompts) == count:
            break
    return prompts


def write_prompts(prompts: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))


def read_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def measure_tau(
    target: TargetModel,
    draft: DraftModel,
    tokenizer: Tokenizer,
    prompts: list[dict],
    temperature: float,
    max_new_tokens: int = 128,
    check_lossless: int = 0,
) -> dict:
    """τ over ``prompts`` with the reference decoder at ``temperature`` (seed = prompt index).

    With ``check_lossless`` > 0, the first that many prompts are also decoded
    target-only with the same sampling and must match token for token.
    """
    decoder = ReferenceDecoder(target, draft)
    stop = tuple(target.config.eos_token_ids)
    accepted, per_prompt, emitted, mismatches = [], [], 0, 0
    start = time.perf_counter()
    for index, prompt in enumerate(tqdm(prompts, desc=f"tau T={temperature}", mininterval=5.0)):
        ids = tokenizer.encode(prompt["prompt"], add_special_tokens=False).ids
        sampling = Sampling(temperature=temperature, seed=index)
        out = decoder.generate_dflash(ids, max_new_tokens, sampling, stop=stop)
        accepted += out.accepted
        per_prompt.append(out.tau)
        emitted += len(out.tokens)
        if index < check_lossless:
            mismatches += decoder.generate_target(ids, max_new_tokens, sampling, stop=stop).tokens != out.tokens
    return {
        "tau": sum(a + 1 for a in accepted) / max(1, len(accepted)),
        "tau_prompt_mean": sum(per_prompt) / len(per_prompt),
        "temperature": temperature,
        "block": draft.config.block_size,
        "prompts": len(prompts),
        "cycles": len(accepted),
        "new_tokens": emitted,
        "max_new_tokens": max_new_tokens,
        "lossless_checked": min(check_lossless, len(prompts)),
        "lossless_mismatches": mismatches,
        "wall_s": round(time.perf_counter() - start, 1),
    }
