"""The training loop shared by the target and the draft.

AdamW (decay on matrices only) with linear warmup and a cosine decay whose
progress is ``max(step / max_steps, elapsed / time_budget_s)``: a run that
hits its wall-time budget still ends at the bottom of the schedule, saves and
reports, instead of being killed mid-step. Random windows of a token stream
make the batches; one seeded generator draws them, so a run is repeatable for
a fixed step count.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def seed_everything(seed: int, device: torch.device) -> torch.Generator:
    """Seeds every library; returns a generator ON ``device`` for batches and anchors, so
    drawing them needs no host-to-device copy (a pageable copy would sync every step)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class Schedule:
    lr: float
    max_steps: int
    time_budget_s: float
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def progress(self, step: int, elapsed_s: float) -> float:
        return max(step / self.max_steps, elapsed_s / self.time_budget_s)

    def lr_at(self, step: int, elapsed_s: float) -> float:
        warm = min(1.0, (step + 1) / max(1, self.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, self.progress(step, elapsed_s))))
        return self.lr * warm * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; no decay on vectors (norm weights, biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused or None)


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on CUDA; plain fp32 elsewhere (CPU smoke runs)."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


class TokenStream:
    """A token stream on the device; batches are random windows of ``length + 1`` tokens."""

    def __init__(self, tokens: np.ndarray, device: torch.device) -> None:
        self.tokens = torch.from_numpy(tokens.astype(np.int32)).to(device)
        self.device = device

    def __len__(self) -> int:
        return self.tokens.numel()

    def batch(self, size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[size, length + 1] int64 windows at offsets drawn from ``generator`` (on the stream's device)."""
        if len(self) < length + 2:
            msg = f"token stream must hold at least {length + 2} tokens (sequence length + 2), got {len(self)}"
            raise ValueError(msg)
        starts = torch.randint(0, len(self) - length - 1, (size,), generator=generator, device=self.device)
        index = starts[:, None] + torch.arange(length + 1, device=self.device)
        return self.tokens[index].long()

    def chunks(self, length: int, limit_tokens: int) -> list[torch.Tensor]:
        """Consecutive non-overlapping [length + 1] windows (held-out evaluation), up to ``limit_tokens``."""
        usable = min(len(self) - 1, limit_tokens)
        count = usable // length
        return [self.tokens[i * length : i * length + length + 1].long() for i in range(count)]


class TrainLog:
    """JSON-lines records to a file (one per ``every`` steps) and a tqdm bar on stderr."""

    def __init__(self, path: Path | None, stage: str, total: int, every: int = 25) -> None:
        self.file = open(path, "a") if path else None  # noqa: SIM115 (closed in close())
        self.stage, self.every = stage, every
        self.bar = tqdm(total=total, desc=stage, mininterval=5.0, dynamic_ncols=True)

    def write(self, record: dict) -> None:
        record = {"stage": self.stage, **record}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        tqdm.write(" ".join(f"{k}={_short(v)}" for k, v in record.items()))

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


StepFn = Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Schedule,
    step_fn: StepFn,
    log: TrainLog,
    clip: float = 1.0,
) -> dict:
    """Run ``step_fn(step) -> (loss, metrics)`` until the schedule ends; returns the last record.

    The host syncs only every ``log.every`` steps (``.item()`` on the metrics).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    start, step, record = time.perf_counter(), 0, {}
    while schedule.progress(step, time.perf_counter() - start) < 1.0:
        lr = schedule.lr_at(step, time.perf_counter() - start)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, metrics = step_fn(step)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log.bar.update(1)
        if step % log.every == 0 or step == 1:
            record = {"step": step, "lr": lr, "loss": loss.item(), "grad_norm": norm.item()}
            record.update({name: value.item() for name, value in metrics.items()})
            record["elapsed_s"] = round(time.perf_counter() - start, 1)
            log.write(record)
    record = {"step": step, "loss": loss.item(), **{k: v.item() for k, v in metrics.items()}}
    record["elapsed_s"] = round(time.perf_counter() - start, 1)
    log.write({"final": True, **record})
    return record
