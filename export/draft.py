"""The DFlash block-diffusion draft (z-lab checkpoint layout).

The draft owns no embedding or LM head: it borrows the target's (frozen).
Per context token, ``c = hidden_norm(fc(taps))``; each draft layer's context
K/V are ``k_norm``/RoPE of ``k_proj(c)`` and ``v_proj(c)`` at the token's own
position, written once into the draft cache (``write_context``). A forward
over a block ``[anchor, MASK × (B-1)]`` at positions ``start .. start+B-1``
attends NON-causally over every committed context slot plus the whole block;
the block's own K/V are written after the context (temporary: the next
cycle's context overwrites them) so validity is one length, ``start + B``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_trt.export.checkpoint import load_into, read_tensors
from dflash_trt.export.config import DraftConfig, load_draft_config
from dflash_trt.export.layers import EAGER, DecoderLayer, RMSNorm, Rotary, materialize, new_cache


class DraftModel(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.config = config
        self.kernels = EAGER
        taps = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(taps, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, causal=False) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.rope, config.head_dim)

    def write_context(
        self,
        taps: torch.Tensor,
        start: torch.Tensor,
        rows: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> None:
        """taps [n, C, m*H] at positions start..start+C-1 -> draft cache slots (every layer)."""
        for index, (k, v) in enumerate(self.context_kv(taps, start)):
            k_cache[index] = self.kernels.write_cache(k_cache[index], rows, start, k)
            v_cache[index] = self.kernels.write_cache(v_cache[index], rows, start, v)

    def context_kv(self, taps: torch.Tensor, start: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context K, V [n, kv_heads, C, D] of taps [n, C, m*H] at positions start.."""
        positions = start[:, None] + torch.arange(taps.shape[1], device=taps.device)  # [n, C]
        c = self.context_features(taps)
        cos, sin = self.rotary(positions, c.dtype)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [n, C, m*H] -> the context rows every layer projects to K/V [n, C, H]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        start: torch.Tensor,
        rows: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """block_embeds [n, B, H] at positions start..start+B-1 -> normed hidden [n, B, H].

        Context slots 0..start-1 of each row must already be written.
        """
        positions = start[:, None] + torch.arange(block_embeds.shape[1], device=start.device)
        x = block_embeds * self.config.embedding_scale if self.config.embedding_scale != 1.0 else block_embeds
        rope = self.rotary(positions, x.dtype)
        for index, layer in enumerate(self.layers):
            x, k_cache[index], v_cache[index] = layer(
                x, rope, positions, rows, start, k_cache[index], v_cache[index], self.kernels
            )
        return self.norm(x)

    def new_cache(self, rows: int, max_context: int, dtype: torch.dtype | None = None, device="cpu"):
        return new_cache(self.config, rows, max_context, dtype or self.fc.weight.dtype, device)


def load_draft(directory: str | Path, dtype: torch.dtype = torch.float32) -> DraftModel:
    """Build a ``DraftModel`` from a z-lab DFlash checkpoint directory (strict load)."""
    config = load_draft_config(directory)
    model = materialize(lambda: DraftModel(config), dtype)
    load_into(model, read_tensors(directory, strip=("model.",)), str(directory))
    return model.eval()
