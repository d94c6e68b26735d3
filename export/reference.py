"""The reference decoder: batch 1, PyTorch eager, no cleverness.

It is the oracle the rest of the project is tested against:
``generate_target`` is plain autoregressive decoding of the target;
``generate_dflash`` runs the draft → verify → accept cycle of docs/design.md §1. Both
choose every token with ``sampling.choose`` at the position being produced
(its noise is a function of seed, position and token), so with the same seed
their outputs are identical (greedy or sampled) — the property the runtime
must preserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_trt.errors import InputError
from dflash_trt.export.draft import DraftModel
from dflash_trt.export.sampling import GREEDY, Sampling, check_sampling, choose, sampling_tensors, verdict
from dflash_trt.export.target import TargetModel


@dataclass
class Generation:
    """New tokens (prompt excluded) and, for DFlash, one entry per cycle."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # a per draft cycle
    proposed: list[int] = field(default_factory=list)  # P per draft cycle
    target_steps: int = 0  # plain decode steps (no draft)

    @property
    def tau(self) -> float:
        """Mean acceptance length, bonus included: mean of a + 1 over draft cycles."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0


class ReferenceDecoder:
    def __init__(self, target: TargetModel, draft: DraftModel | None = None, max_context: int | None = None):
        self.target, self.draft, self.max_context = target, draft, max_context
        self.row = torch.zeros(1, dtype=torch.int64)

    def _choose(self, logits: torch.Tensor, positions: range, sampling: Sampling) -> list[int]:
        """logits [R, V]; the R tokens produced AT ``positions``."""
        if sampling.temperature == 0:  # choose's greedy rows, without computing their unused noise
            return logits.float().argmax(dim=-1).tolist()
        position = torch.tensor(list(positions), dtype=torch.int64)
        return choose(logits.float(), *sampling_tensors(sampling, len(positions)), position).tolist()

    def _target(self, tokens: list[int], start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
        logits, taps = self.target(
            torch.tensor([tokens]), torch.tensor([start]), self.row, cache[0], cache[1]
        )
        return logits[0], taps[0]

    def _setup(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, extra: int) -> int:
        vocab = self.target.config.vocab_size
        check_sampling(sampling.temperature, sampling.top_k, sampling.top_p, vocab)
        if not prompt:
            raise InputError("prompt must hold at least 1 token, got 0")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt token must be in [0, {vocab - 1}], got {bad[0]}")
        length = self.max_context or len(prompt) + max_new_tokens + extra
        if len(prompt) + max_new_tokens > length:
            raise InputError(
                f"prompt + max_new_tokens must be <= max_context {length}, got {len(prompt) + max_new_tokens}"
            )
        return length

    @torch.no_grad()
    def generate_target(
        self, prompt: list[int], max_new_tokens: int, sampling: Sampling = GREEDY, stop: tuple[int, ...] = ()
    ) -> Generation:
        length = self._setup(prompt, max_new_tokens, sampling, 0)
        cache = self.target.new_cache(1, length)
        logits, _ = self._target(prompt, 0, cache)
        out = Generation(self._choose(logits[-1:], range(len(prompt), len(prompt) + 1), sampling))
        while len(out.tokens) < max_new_tokens and out.tokens[-1] not in stop:
            position = len(prompt) + len(out.tokens) - 1  # of the last token, now fed
            logits, _ = self._target([out.tokens[-1]], position, cache)
            out.tokens += self._choose(logits, range(position + 1, position + 2), sampling)
            out.target_steps += 1
        return out

    @torch.no_grad()
    def generate_dflash(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        proposals: int | None = None,
        stop: tuple[int, ...] = (),
    ) -> Generation:
        assert self.draft is not None, "generate_dflash needs a draft"
        block = self.draft.config.block_size
        proposals = proposals or block - 1
        if not 2 <= proposals <= block - 1:
            raise InputError(f"proposals must be in [2, {block - 1}] (block size - 1), got {proposals}")
        length = self._setup(prompt, max_new_tokens, sampling, block)
        t_cache, d_cache = self.target.new_cache(1, length), self.draft.new_cache(1, length)
        logits, context = self._target(prompt, 0, t_cache)
        out = Generation(self._choose(logits[-1:], range(len(prompt), len(prompt) + 1), sampling))
        frontier, draft_position = len(prompt), 0  # target cache holds 0..frontier-1
        while len(out.tokens) < max_new_tokens and out.tokens[-1] not in stop:
            anchor, start = out.tokens[-1], frontier
            if start + block <= length:
                self.draft.write_context(context[None], torch.tensor([draft_position]), self.row, *d_cache)
                draft_position = start
                guesses = self._propose(anchor, start, proposals, d_cache)
                logits, taps = self._target([anchor, *guesses], start, t_cache)
                choices = self._choose(logits, range(start + 1, start + proposals + 2), sampling)
                accepted, _ = verdict(torch.tensor([guesses]), torch.tensor([choices]))
                a = int(accepted[0])
                emitted, context = choices[: a + 1], taps[: a + 1]
                out.accepted.append(a)
                out.proposed.append(proposals)
            else:  # the block no longer fits the context: plain target decode
                logits, taps = self._target([anchor], start, t_cache)
                emitted = self._choose(logits, range(start + 1, start + 2), sampling)
                context = torch.cat([context, taps])
                out.target_steps += 1
            frontier = start + len(emitted)
            out.tokens += _until_stop(emitted, stop)[: max_new_tokens - len(out.tokens)]
        return out

    def _propose(self, anchor: int, start: int, proposals: int, d_cache) -> list[int]:
        """The draft's greedy proposals d_1..d_P for block [anchor, MASK...] at ``start``."""
        config = self.draft.config
        block = torch.tensor([[anchor] + [config.mask_token_id] * (config.block_size - 1)])
        hidden = self.draft(self.target.embed(block), torch.tensor([start]), self.row, *d_cache)
        return self.target.head(hidden[0, 1 : proposals + 1]).argmax(-1).tolist()


def _until_stop(tokens: list[int], stop: tuple[int, ...]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop:
            return tokens[: index + 1]
    return tokens
