"""The pure-torch twin of the fast kernels: same signatures, same launch plans, same math.

``TritonOps`` (CUDA) and ``TorchOps`` (any device) are interchangeable under
the fused graph modules (``kernels.modules``). The twin is what the CPU tests
run: it checks the fused-weight arithmetic (RMSNorm applied as a per-row scale
after the GEMM, SiLU·mul on a gate|up product, in-place residual adds), the
q/k-norm + RoPE + KV write, and the split-K attention with its log-sum-exp
combine, against the reference modules (``export.layers``); the Triton kernels
are checked against the twin and the reference on a GPU.

``TorchOps`` is also a ``Kernels`` object of ``export.layers`` (``write_cache``
and ``attention`` with ``EagerKernels``' signatures).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.export.layers import EagerKernels
from dflash_trt.runtime.kernels.plan import attention_plan


class TorchOps(EagerKernels):
    """Fast-kernel math in plain torch. ``splits`` forces the attention split count (tests)."""

    processors = 1  # the attention plan's program target on a CPU
    fp8_linear = True  # ``linear(..., scale=)``: fp8 weights (``kernels.quant``)

    def __init__(self, splits: int | None = None) -> None:
        self.splits = splits

    def embed(self, table, start, tokens=None, anchor=None, mask_id=0, block=0, scale=1.0):
        """Rows of ``table`` [V, H] for tokens [n, T] (or the draft's block: anchor [n], then ``block`` - 1
        mask tokens), times ``scale``; with their positions start[i] + t [n, T] and the attention's length
        start + T [n] -> (x [n*T, H] (a fresh tensor), positions, lengths)."""
        if tokens is None:
            masks = torch.full((anchor.shape[0], block - 1), mask_id, dtype=anchor.dtype, device=anchor.device)
            tokens = torch.cat([anchor[:, None], masks], dim=1)
        n, T = tokens.shape
        x = F.embedding(tokens.reshape(n * T), table)
        if scale != 1.0:
            x = x * scale
        return x, start[:, None] + torch.arange(T, device=start.device), start + T

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        gated: bool = False,
        residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        tap: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y [M, N] = epilogue(prologue(x) [M, K] @ weight.T); see ``TritonOps.linear`` for the options.

        The result is rounded to the weight dtype (what the reference's Linear returns) before it is
        stored as ``out_dtype`` (default: the weight dtype). ``scale`` [N or 2N] fp32: ``weight`` is fp8
        (``kernels.quant.fp8_rows``), the product is multiplied by it per feature, and the result is rounded
        to x's dtype instead.
        """
        rounding = x.dtype if scale is not None else weight.dtype
        xf = x.float()
        if norm is not None:
            # RMSNorm(x) @ W.T == rsqrt(mean(x^2) + eps) * ((x * g) @ W.T): the scale is per row.
            row_scale = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            xf = (xf * norm.float()).to(rounding).float()
        y = xf @ weight.float().T  # [M, N or 2N]
        if scale is not None:
            y = y * scale.float()
        if norm is not None:
            y = y * row_scale
        if bias is not None:
            y = y + bias.float()
        if gated:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        if residual is not None:
            y = y + residual.float()
        y = y.to(rounding).to(out_dtype or rounding)
        if tap is not None:
            tap.copy_(y)
        if out is None:
            return y
        return out.copy_(y)

    def qk_rope_write(
        self,
        qkv: torch.Tensor,
        start: torch.Tensor,
        tokens: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        inv_freq: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """qkv [n*T, (heads + 2 kv_heads) * D] of rows at positions start[i] + t (slot = position).

        Writes K (k-norm, RoPE) and V at those slots of the caches [n, kv_heads, L, D] (or, with
        ``rows`` [n], of rows rows[i] of whole pools [R, kv_heads, L, D]); with ``lengths`` [n] only
        the first lengths[i] rows of owner i are written (a ragged batch padded to T). Returns Q
        [n, T, heads, D] (q-norm, RoPE), or None when ``heads`` is 0 (a K|V-only input).
        """
        n, D = qkv.shape[0] // tokens, head_dim
        positions = start[:, None] + torch.arange(tokens, device=start.device)  # [n, T]
        angles = positions.float()[..., None, None] * inv_freq  # [n, T, 1, D/2]
        cos, sin = angles.cos(), angles.sin()

        def rotary(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:  # [n, T, h, D]
            x = x.float()
            if weight is not None:
                x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
            first, second = x[..., : D // 2], x[..., D // 2 :]
            return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

        def columns(first: int, count: int) -> torch.Tensor:
            return qkv[:, first * D : (first + count) * D].reshape(n, tokens, count, D)

        owners = (rows if rows is not None else torch.arange(n, device=start.device))[:, None].expand(n, tokens)
        keys, values = rotary(columns(heads, kv_heads), k_norm), columns(heads + kv_heads, kv_heads)  # [n, T, h, D]
        if lengths is not None:  # only the real rows of a padded batch
            real = torch.arange(tokens, device=start.device) < lengths[:, None]
            owners, positions, keys, values = owners[real], positions[real], keys[real], values[real]
        k_cache[owners, :, positions] = keys.to(k_cache.dtype)
        v_cache[owners, :, positions] = values.to(v_cache.dtype)
        if not heads:
            return None
        return rotary(columns(0, heads), q_norm).to(qkv.dtype)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        rows: torch.Tensor | None,
        q_positions: torch.Tensor,
        kv_len: torch.Tensor,
        causal: bool,
        window: int,
    ) -> torch.Tensor:
        """``EagerKernels.attention``, computed the way the split-K kernel does (-> [n, Hq, T, D])."""
        if rows is not None:
            k_cache, v_cache = k_cache[rows], v_cache[rows]
        n, heads, T, D = q.shape
        kv_heads, L = k_cache.shape[1], k_cache.shape[2]
        group = heads // kv_heads
        plan = attention_plan(n, kv_heads, group, T, D, L, self.processors, self.splits)
        # Query rows r = t * group + g of kv head h: q[i, h * group + g, t].
        qr = q.float().reshape(n, kv_heads, group, T, D).transpose(2, 3).reshape(n, kv_heads, T * group, D)
        positions = q_positions[:, :, None].expand(n, T, group).reshape(n, T * group)  # [n, R]
        scores = qr @ k_cache.float().transpose(-1, -2) / D**0.5  # [n, Hkv, R, L]
        slots = torch.arange(L, device=q.device)
        visible = slots < kv_len[:, None, None]  # [n, 1, L]
        if causal:
            visible = visible & (slots <= positions[..., None])
        if window:
            visible = visible & (positions[..., None] - slots < window)
        out = torch.cat(
            [
                _query_block(scores, v_cache.float(), visible, positions, kv_len, slots, plan, block, causal, window)
                for block in range(plan.query_blocks)
            ],
            dim=2,
        )  # [n, Hkv, R, D]
        out = out.reshape(n, kv_heads, T, group, D).transpose(1, 2).reshape(n, T, heads, D)
        return out.to(q.dtype).transpose(1, 2)


def _query_block(scores, values, visible, positions, kv_len, slots, plan, block, causal, window) -> torch.Tensor:
    """Rows of one query block: each split's softmax over its slots, combined by log-sum-exp."""
    r0, r1 = block * plan.block_q, min((block + 1) * plan.block_q, scores.shape[2])
    rows_pos = positions[:, r0:r1]  # [n, rb]
    hi = kv_len.clone()
    if causal:
        hi = torch.minimum(hi, rows_pos.max(dim=1).values + 1)
    lo = (rows_pos.min(dim=1).values - window + 1).clamp(min=0) if window else torch.zeros_like(hi)
    width = (hi - lo).clamp(min=0)
    chunk = -(-(-(-width // plan.splits)) // plan.block_n) * plan.block_n  # cdiv(cdiv(w, S), bn) * bn
    outs, lses = [], []
    for split in range(plan.splits):
        a = lo + split * chunk
        b = torch.minimum(a + chunk, hi)
        inside = (slots >= a[:, None]) & (slots < b[:, None])  # [n, L]
        mask = (visible[:, r0:r1] if visible.shape[1] > 1 else visible) & inside[:, None, :]  # [n, rb, L]
        s = scores[:, :, r0:r1].masked_fill(~mask[:, None], float("-inf"))
        top = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        total = p.sum(dim=-1, keepdim=True)  # [n, Hkv, rb, 1]; 0 where the split sees no slot
        outs.append((p @ values) / total.clamp_min(1e-30))
        lses.append(torch.where(total > 0, top + torch.log(total), torch.full_like(total, float("-inf"))))
    lse = torch.stack(lses)  # [S, n, Hkv, rb, 1]
    weights = torch.exp(lse - lse.amax(dim=0, keepdim=True))
    return (weights * torch.stack(outs)).sum(dim=0) / weights.sum(dim=0)
