"""Sampling and verification math: small pure functions over tensors.

One definition serves the reference decoder, the exported verifier graphs and
the runtime.

- ``positional_uniform(seed, positions)``: the random number that decides the
  token AT a position is a pure function of (seed, position, purpose), so a
  session's output never depends on how it was batched. Purpose
  ``PURPOSE_TOKEN`` is used for every target choice, in prefill, in plain
  decode and in verification alike: DFlash's sampled output is therefore
  token-for-token the target-only sampled output for the same seed.
- ``filtered_probs``: temperature, then top-k, then top-p (HF order), per
  row. Temperature 0 gives the one-hot argmax, so greedy and sampled rows
  share one code path.
- ``sample``: inverse CDF in vocabulary order with the row's uniform.
- ``verdict``: accepting a one-hot draft token d by testing ``d == y`` with
  ``y`` an independent target sample is exactly rejection sampling with a
  one-hot proposal (accept w.p. p(d); on reject ``y`` follows p without d,
  renormalized), hence lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dflash_trt.checks import is_int
from dflash_trt.errors import SamplingError

PURPOSE_TOKEN = 0
_MASK64 = (1 << 64) - 1


def _mix(value: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over uint64 arrays (wrapping arithmetic)."""
    value = value + np.uint64(0x9E3779B97F4A7C15)
    value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return value ^ (value >> np.uint64(31))


def positional_uniform(seed: int, positions, purpose: int = PURPOSE_TOKEN) -> np.ndarray:
    """float32 uniforms in [0, 1), one per position: a pure function of (seed, position, purpose)."""
    positions = np.atleast_1d(np.asarray(positions, dtype=np.int64)).astype(np.uint64)
    with np.errstate(over="ignore"):
        key = np.uint64(seed & _MASK64) ^ _mix(np.array([purpose], dtype=np.uint64))
        value = _mix(key ^ _mix(positions + np.uint64(1)))
    # Top 24 bits: exactly representable in float32, strictly below 1.
    return ((value >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)


@dataclass(frozen=True)
class Sampling:
    """One session's sampling parameters; the default is greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def tensors(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.full((rows,), float(self.temperature)),
            torch.full((rows,), int(self.top_k), dtype=torch.int64),
            torch.full((rows,), float(self.top_p)),
        )


GREEDY = Sampling()


def check_sampling(temperature: float, top_k: int, top_p: float, vocab_size: int | None = None) -> None:
    """Refuse out-of-range sampling parameters, naming the field, range and value."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise SamplingError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not is_int(top_k) or top_k < 0:
        raise SamplingError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if vocab_size is not None and top_k > vocab_size:
        raise SamplingError(f"top_k must be in [0, {vocab_size}] (the vocabulary), got {top_k}")
    if not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p!r}")


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits [R, V]; per-row temperature, top_k (0 = off), top_p [R] -> probs [R, V] fp32."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / scale[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    keep = rank[None, :] < k[:, None]
    p = torch.softmax(torch.where(keep, ordered, torch.full_like(ordered, float("-inf"))), dim=-1)
    keep = keep & ((torch.cumsum(p, dim=-1) - p) < top_p[:, None])
    p = torch.where(keep, p, torch.zeros_like(p))
    p = p / p.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(p).scatter(-1, order, p)
    one_hot = torch.zeros_like(probs).scatter(-1, order[:, :1], torch.ones_like(probs[:, :1]))
    return torch.where(greedy[:, None], one_hot, probs)


def sample(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """probs [R, V], uniform [R] in [0, 1) -> int64 tokens [R] by inverse CDF in vocab order."""
    cdf = torch.cumsum(probs, dim=-1)
    threshold = uniform.float()[:, None] * cdf[:, -1:]
    # The first index whose CDF exceeds the threshold always has p > 0.
    return (cdf <= threshold).sum(dim=-1).clamp(max=probs.shape[-1] - 1).to(torch.int64)


def choose(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> torch.Tensor:
    """The target's token for each row of logits [R, V] -> [R] int64."""
    return sample(filtered_probs(logits, temperature, top_k, top_p), uniform)


def verdict(proposals: torch.Tensor, choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """proposals [n, P], target choices [n, P+1] -> (accepted [n], next token [n]).

    accepted = longest prefix with proposals[:, i] == choices[:, i]; the
    emitted tokens are choices[:, :accepted+1] (the last is the correction,
    or the bonus when accepted == P).
    """
    # Count the leading positions with no mismatch so far (cumsum, not cumprod:
    # ONNX has no CumProd, and this is the exported verifiers' math too).
    mismatches = (proposals != choices[:, :-1]).to(torch.int64)
    accepted = (torch.cumsum(mismatches, dim=1) == 0).to(torch.int64).sum(dim=1)
    return accepted, torch.gather(choices, 1, accepted[:, None])[:, 0]
