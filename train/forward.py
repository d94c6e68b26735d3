"""Training forwards: whole sequences, no KV cache, same modules as inference.

``target_forward`` runs a ``TargetModel``'s own submodules (embedding, layers'
norms / projections / MLP, final norm) with plain causal attention over the
sequence, so a trained checkpoint means exactly what ``TargetModel.forward``
computes over its cache rows. ``draft_forward`` runs a ``DraftModel`` over
many blocks of one sequence at once (docs/design.md §1 Training): context K/V are
computed once per sequence from ``c = hidden_norm(fc(taps))`` exactly as
``DraftModel.write_context`` does; block ``j`` (anchor ``a_j``) sees context
positions ``< a_j`` and its own ``B`` slots (bidirectional), nothing of other
blocks. Tests assert both equal the cache path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_trt.export.draft import DraftModel
from dflash_trt.export.target import TargetModel


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on (SDPA wants one dtype), else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _attend(q, k, v, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q [b, Hq, T, D], k/v [b, Hkv, S, D] (GQA groups expanded here) -> [b, Hq, T, D]."""
    dtype = _compute_dtype(q)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).to(dtype)
    v = v.repeat_interleave(groups, dim=1).to(dtype)
    return F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=mask, is_causal=causal)


def _window_mask(length: int, window: int, device) -> torch.Tensor:
    """[T, T] bool: causal and within ``window`` positions (the cache path's rule)."""
    p = torch.arange(length, device=device)
    distance = p[:, None] - p[None, :]
    return (distance >= 0) & (distance < window)


def target_forward(
    model: TargetModel, tokens: torch.Tensor, tap_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [b, T] at positions 0..T-1 -> (final-normed hidden [b, T, H], taps [b, T, m*H] or None).

    Logits are ``model.head(hidden)``; kept apart so a loss can chunk them.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    x = model.embed(tokens)
    cos, sin = model.rotary(positions, x.dtype)
    taps = []
    for index, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        q = layer.self_attn.query(h, cos, sin)
        k, v = layer.self_attn.key_value(h, cos, sin)
        if layer.window:
            attended = _attend(q, k, v, _window_mask(tokens.shape[1], layer.window, x.device), False)
        else:
            attended = _attend(q, k, v, None, True)
        x = x + layer.self_attn.output(attended)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if index in tap_layers:
            taps.append(model.tap_of(index, x))
    return model.model.norm(x), (torch.cat(taps, dim=-1) if taps else None)


def block_positions(anchors: torch.Tensor, block: int) -> torch.Tensor:
    """anchors [b, n] -> positions [b, n*B] of the blocks' slots (anchor + k)."""
    offsets = torch.arange(block, device=anchors.device)
    return (anchors[..., None] + offsets).flatten(1)


def block_mask(anchors: torch.Tensor, context: int, block: int) -> torch.Tensor:
    """[b, 1, n*B, context + n*B] bool: what each block slot attends to.

    Context key ``p`` is visible to block ``j`` iff ``p < anchor_j`` (STRICTLY
    before: the anchor's own taps are not known when drafting); block keys are
    visible iff they belong to the same block.
    """
    b, n = anchors.shape
    query_anchor = anchors.repeat_interleave(block, dim=1)  # [b, n*B]
    p = torch.arange(context, device=anchors.device)
    sees_context = p[None, None, :] < query_anchor[..., None]  # [b, n*B, C]
    owner = torch.arange(n, device=anchors.device).repeat_interleave(block)  # [n*B]
    sees_block = (owner[:, None] == owner[None, :]).expand(b, -1, -1)  # [b, n*B, n*B]
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def draft_forward(
    draft: DraftModel, taps: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Many blocks of one sequence per row, one forward.

    taps [b, C, m*H] (positions 0..C-1); block_embeds [b, n*B, H] (block j =
    [x_{a_j}, MASK...] embedded); anchors [b, n] -> normed hidden [b, n*B, H].
    """
    block = draft.config.block_size
    b, context = taps.shape[:2]
    c = draft.hidden_norm(draft.fc(taps.to(draft.fc.weight.dtype)))
    context_positions = torch.arange(context, device=taps.device).expand(b, -1)
    context_rope = draft.rotary(context_positions, c.dtype)
    positions = block_positions(anchors, block)
    scale = draft.config.embedding_scale
    x = block_embeds * scale if scale != 1.0 else block_embeds
    cos, sin = draft.rotary(positions, x.dtype)
    mask = block_mask(anchors, context, block)
    for layer in draft.layers:
        h = layer.input_layernorm(x)
        q = layer.self_attn.query(h, cos, sin)
        k_block, v_block = layer.self_attn.key_value(h, cos, sin)
        k_context, v_context = layer.self_attn.key_value(c, *context_rope)
        dtype = _compute_dtype(q)
        k = torch.cat([k_context.to(dtype), k_block.to(dtype)], dim=2)
        v = torch.cat([v_context.to(dtype), v_block.to(dtype)], dim=2)
        x = x + layer.self_attn.output(_attend(q, k, v, mask, False))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return draft.norm(x)
