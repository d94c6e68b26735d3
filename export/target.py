"""The target LLM (Qwen3 / Llama) over the KV-cache row layout.

``forward(tokens, start, rows, k_cache, v_cache)`` runs ``n`` rows of ``T``
tokens each; row ``i`` holds tokens at positions ``start[i] .. start[i]+T-1``
of cache row ``rows[i]``. It writes their K/V into the caches in place and
returns fp32 logits and the taps of ``tap_layers`` (0-indexed decoder layers),
concatenated along the feature axis. Layer i's tap is Hugging Face's
``hidden_states[i + 1]``, which is what the DFlash reference feeds its draft:
the residual-stream output of the layer, except for the LAST layer, whose
entry is the final-normed state (``tap_of``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_trt.export.checkpoint import load_into, read_tensors
from dflash_trt.export.config import TargetConfig, load_target_config
from dflash_trt.export.layers import EAGER, DecoderLayer, RMSNorm, Rotary, materialize, new_cache
from dflash_trt.errors import ConfigError


class Backbone(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, causal=True, window=w) for w in config.windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig, tap_layers: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.config = config
        self.tap_layers = tuple(tap_layers) if tap_layers else config.default_tap_layers(1)
        if not all(0 <= i < config.num_layers for i in self.tap_layers):
            raise ConfigError(f"tap layers must be in [0, {config.num_layers - 1}], got {list(self.tap_layers)}")
        self.kernels = EAGER
        self.model = Backbone(config)
        self.rotary = Rotary(config.rope, config.head_dim)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tap_width(self) -> int:
        return len(self.tap_layers) * self.config.hidden_size

    def tap_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s tap from its residual output x: HF's ``hidden_states[index + 1]``.

        HF records the last layer's entry after the final norm, and DFlash's
        reference (``hidden_states[layer_id + 1]``) feeds exactly that to a
        draft that taps the last layer; the other layers are tapped un-normed.
        """
        return self.model.norm(x) if index == self.config.num_layers - 1 else x

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> fp32 logits [..., V]."""
        return self.lm_head(hidden).float()

    def forward(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        rows: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [n, T] -> logits [n, T, V] fp32, taps [n, T, m*H]; caches updated in place."""
        hidden, taps = self.features(tokens, start, rows, k_cache, v_cache)
        return self.head(hidden), taps

    def features(
        self,
        tokens: torch.Tensor,
        start: torch.Tensor,
        rows: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` before the LM head: final-normed hidden [n, T, H], taps [n, T, m*H].

        Lets a caller apply the head to some rows only (prefill needs the last).
        """
        positions = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # [n, T]
        x = self.embed(tokens)
        rope = self.rotary(positions, x.dtype)
        taps = []
        for index, layer in enumerate(self.model.layers):
            x, k_cache[index], v_cache[index] = layer(
                x, rope, positions, rows, start, k_cache[index], v_cache[index], self.kernels
            )
            if index in self.tap_layers:
                taps.append(self.tap_of(index, x))
        return self.model.norm(x), torch.cat(taps, dim=-1)

    def new_cache(self, rows: int, max_context: int, dtype: torch.dtype | None = None, device="cpu"):
        dtype = dtype or self.lm_head.weight.dtype
        return new_cache(self.config, rows, max_context, dtype, device)


def load_target(
    directory: str | Path,
    tap_layers: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> TargetModel:
    """Build a ``TargetModel`` from an HF checkpoint directory (strict load)."""
    config = load_target_config(directory)
    model = materialize(lambda: TargetModel(config, tap_layers), dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    tensors = read_tensors(directory)
    ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
    load_into(model, tensors, str(directory), ignore=ignore)
    return model.eval()
