"""The draft's weights in fp8 (e4m3), one scale per output row: half the bytes a draft launch streams.

A DFlash cycle on a large pair streams the draft's weights and the LM head once per cycle (the Qwen3-8B
shape: five 8B-sized layers and the 1.24 GB head, ~1.2 ms of a 6.35 ms cycle on the H200). The draft only
proposes; the target's verify decides every token, so the draft's precision moves the acceptance, never the
output: DFlash equals plain decoding with an fp8 draft as with a bf16 one (the exact kernels' guarantee is
the target's). The target's weights are never quantized.

``fp8_rows(w)`` -> (q, scale): w [N, K] ≈ q * scale[:, None], each row's largest magnitude mapped to e4m3's
largest finite value (448), so every element keeps e4m3's 3 mantissa bits (relative error ≤ 2^-4 for an
element within the normal range of its row). Kernels multiply the product by the scale in their epilogue
(``ops.linear(..., scale=)``): y = (x @ q.T) * scale, the activations unquantized.
"""

from __future__ import annotations

import torch

from dflash_trt.errors import EngineError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
DRAFT_WEIGHTS = ("model", "fp8")  # the draft's weights: the model's dtype, or fp8 with a scale per row
QUANT_ROWS = 16384  # rows quantized per step (the 8B LM head in fp32 at once would be a 2.5 GB temporary)


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] float8_e4m3fn, scale [N] fp32) with weight ≈ q * scale[:, None].

    An all-zero row gets scale 1 (its q is zeros). Rounding: to nearest, e4m3's own (``Tensor.to``)."""
    if weight.dim() != 2:
        raise ValueError(f"fp8_rows: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    q = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], QUANT_ROWS):
        w = weight[lo : lo + QUANT_ROWS].detach().float()
        amax = w.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q[lo : lo + QUANT_ROWS] = (w / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        scale[lo : lo + QUANT_ROWS] = s
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale[:, None] in fp32: the weight an fp8 linear multiplies by (the references' and tests')."""
    return q.float() * scale[:, None]


def check_draft_weights(draft_weights: str) -> str:
    """``draft_weights`` if it is one of ``DRAFT_WEIGHTS``, else an ``EngineError`` naming them."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise EngineError(f"draft_weights must be one of {list(DRAFT_WEIGHTS)}, got {draft_weights!r}")
    return draft_weights


__all__ = ["DRAFT_WEIGHTS", "FP8", "FP8_MAX", "check_draft_weights", "dequantized", "fp8_rows"]
