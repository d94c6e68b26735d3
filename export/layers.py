"""Building blocks shared by the target and the draft: RMSNorm, RoPE, SwiGLU,
and the cache kernels (KV write + attention over cache rows).

Cache layout (docs/design.md §2): one tensor per layer, ``[rows, kv_heads,
max_context, head_dim]``; slot ``j`` of a row holds the K (or V) of position
``j``. Validity is expressed as a length (``kv_len``) plus causality and an
optional sliding window; stale slots past the length are never read.

``EagerKernels`` is the PyTorch reference of the two cache operations. The
exporter supplies another ``Kernels`` object whose methods emit the ONNX
``TensorScatter`` / ``Attention`` nodes; the modules only call through
``self.kernels``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.export.config import AttentionConfig, RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the HF reference, scale in the input dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] fp32 inverse frequencies, with linear / llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind != "llama3":
        return inv
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin tables computed from explicit positions (no cached max length)."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", inverse_frequencies(rope, head_dim), persistent=False)

    def _apply(self, fn, recurse=True):
        # Keep the frequencies fp32 when the model is cast to bf16/fp16.
        frequencies = self.inv_freq
        super()._apply(fn, recurse)
        if frequencies.device.type != "meta" and self.inv_freq.device.type != "meta":
            self.inv_freq = frequencies.to(device=self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [n, T] -> cos, sin [n, 1, T, head_dim]
        freqs = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagerKernels:
    """PyTorch reference of the cache operations (in place on the cache)."""

    def write_cache(
        self, cache: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, new: torch.Tensor
    ) -> torch.Tensor:
        """cache [R, H, L, D]; rows, start [n]; new [n, H, T, D] -> slots start..start+T-1.

        ``rows=None``: the cache IS the n owners' rows (the graph wrappers' case).
        """
        positions = start[:, None] + torch.arange(new.shape[2], device=start.device)  # [n, T]
        if rows is None:
            rows = torch.arange(cache.shape[0], device=cache.device)
        cache[rows[:, None], :, positions] = new.transpose(1, 2).to(cache.dtype)
        return cache

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor,
        q_positions: torch.Tensor,
        kv_len: torch.Tensor,
        causal: bool,
        window: int,
    ) -> torch.Tensor:
        """q [n, Hq, T, D] over cache rows -> [n, Hq, T, D].

        Key slot j is visible to a query at position p iff j < kv_len and, if
        causal, j <= p and, with a window w > 0, p - j < w.
        """
        # rows=None: the caches are exactly the owners' rows, so no gather (copy) is needed.
        k, v = (k_cache, v_cache) if rows is None else (k_cache[rows], v_cache[rows])  # [n, Hkv, L, D]
        slots = torch.arange(k.shape[2], device=q.device)
        visible = slots[None, None, :] < kv_len[:, None, None]  # [n, 1, L]
        p = q_positions[..., None]  # [n, T, 1]
        if causal:
            visible = visible & (slots <= p)
        if window:
            visible = visible & (p - slots < window)
        mask = visible.expand(q.shape[0], q.shape[2], k.shape[2])[:, None]  # [n, 1, T, L]
        # enable_gqa: query heads share K/V heads without materializing repeated K/V.
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=True)


EAGER = EagerKernels()


class Attention(nn.Module):
    """Q/K/V/O projections with optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x: torch.Tensor, heads: int, norm: RMSNorm | None) -> torch.Tensor:
        # [n, T, heads * D] -> [n, heads, T, D]
        x = x.view(*x.shape[:2], heads, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(1, 2)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate(self._heads(self.q_proj(x), self.heads, self.q_norm), cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, T, H] -> K, V [n, kv_heads, T, D] (K normed and rotated)."""
        k = rotate(self._heads(self.k_proj(x), self.kv_heads, self.k_norm), cos, sin)
        return k, self._heads(self.v_proj(x), self.kv_heads, None)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        # [n, Hq, T, D] -> [n, T, H]
        return self.o_proj(attended.transpose(1, 2).reshape(attended.shape[0], attended.shape[2], -1))


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block over cache rows (the target's and the draft's layers).

    The target's layers are causal (with an optional sliding window); the
    draft's attend non-causally over every committed context slot + the block.
    """

    def __init__(self, config: AttentionConfig, causal: bool, window: int = 0) -> None:
        super().__init__()
        self.causal, self.window = causal, window
        self.self_attn = Attention(config)
        self.mlp = SwiGLU(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope, positions, rows, start, k_cache, v_cache, kernels):
        """x [n, T, H] at positions [n, T]: writes its K/V at slots start.., attends over slots < start + T."""
        cos, sin = rope
        h = self.input_layernorm(x)
        q = self.self_attn.query(h, cos, sin)
        k, v = self.self_attn.key_value(h, cos, sin)
        k_cache = kernels.write_cache(k_cache, rows, start, k)
        v_cache = kernels.write_cache(v_cache, rows, start, v)
        kv_len = start + x.shape[1]
        attended = kernels.attention(q, k_cache, v_cache, rows, positions, kv_len, self.causal, self.window)
        x = x + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


def materialize(build, dtype: torch.dtype) -> nn.Module:
    """``build()`` on the meta device (no weight init), then allocated on the CPU in ``dtype``.

    For loaders that overwrite every parameter; the RoPE frequencies, which no
    checkpoint holds, are recomputed in fp32.
    """
    with torch.device("meta"):
        model = build()
    model = model.to_empty(device="cpu").to(dtype)
    for module in model.modules():
        if isinstance(module, Rotary):
            module.inv_freq = inverse_frequencies(module.rope, module.head_dim)
    return model


def new_cache(
    config: AttentionConfig, rows: int, max_context: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed K and V caches, one [rows, kv_heads, max_context, head_dim] tensor per layer."""
    shape = (rows, config.num_kv_heads, max_context, config.head_dim)
    keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
    values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
    return keys, values
