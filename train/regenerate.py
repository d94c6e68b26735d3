"""Target-regenerated training data for the draft.

A draft is accepted when it predicts what the TARGET emits, not what the
corpus says next; as in the DFlash paper (and SpecForge), the draft trains on
text the target wrote. Each sequence is a real corpus prefix of ``prefix``
tokens continued by the target for ``length - prefix`` tokens (greedy for a
``greedy_share`` of the rows, temperature-1 sampling for the rest), decoded
through the target's own KV-cache forward. The training loss stays that of
docs/design.md §1: cross-entropy against ``x[anchor + k]`` of these sequences.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from dflash_trt.export.target import TargetModel
from dflash_trt.train.loop import TokenStream


class SequenceBank:
    """Fixed-length sequences on the device; batches are random whole rows (TokenStream's interface)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows, self.device = rows, rows.device

    def __len__(self) -> int:
        return self.rows.numel()

    def batch(self, size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[size, length + 1] int64: the first ``length + 1`` tokens of random rows."""
        if length + 1 > self.rows.shape[1]:
            raise ValueError(f"sequence length must be <= {self.rows.shape[1] - 1} (the bank's rows), got {length}")
        pick = torch.randint(0, self.rows.shape[0], (size,), generator=generator, device=self.device)
        return self.rows[pick, : length + 1].long()


def _choose(logits: torch.Tensor, greedy: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """logits [r, V] -> [r]: argmax where ``greedy``, else a temperature-1 sample."""
    sampled = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator)[:, 0]
    return torch.where(greedy, logits.argmax(-1), sampled)


@torch.no_grad()
def continue_rows(
    target: TargetModel, prompts: torch.Tensor, new_tokens: int, greedy: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """prompts [r, P] -> [r, P + new_tokens]: each row continued by the target (one cache row each)."""
    rows, length = prompts.shape[0], prompts.shape[1] + new_tokens
    device = prompts.device
    cache = target.new_cache(rows, length, device=device)
    index = torch.arange(rows, device=device)
    logits, _ = target(prompts, torch.zeros(rows, dtype=torch.int64, device=device), index, *cache)
    out = [prompts, _choose(logits[:, -1], greedy, generator)[:, None]]
    for step in range(new_tokens - 1):
        start = torch.full((rows,), prompts.shape[1] + step, dtype=torch.int64, device=device)
        logits, _ = target(out[-1], start, index, *cache)
        out.append(_choose(logits[:, -1], greedy, generator)[:, None])
    return torch.cat(out, dim=1)


def regenerate(
    target: TargetModel,
    stream: TokenStream,
    prefix: int,
    length: int,
    greedy_share: float,
    generator: torch.Generator,
    time_budget_s: float,
    batch_rows: int = 2048,
    max_rows: int = 1 << 20,
) -> SequenceBank:
    """Batches of ``batch_rows`` regenerated sequences until ``time_budget_s`` or ``max_rows``."""
    start, parts = time.perf_counter(), []
    greedy = torch.arange(batch_rows, device=stream.device) < round(greedy_share * batch_rows)
    bar = tqdm(desc="regenerate", unit="row", mininterval=5.0)
    while time.perf_counter() - start < time_budget_s and sum(p.shape[0] for p in parts) < max_rows:
        prompts = stream.batch(batch_rows, prefix - 1, generator)
        parts.append(continue_rows(target, prompts, length - prefix, greedy, generator).to(torch.int32))
        bar.update(batch_rows)
    bar.close()
    return SequenceBank(torch.cat(parts))
