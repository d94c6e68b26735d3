"""Fused weights made at load time, and the decoder math of the fast path over them.

``fuse_layer`` concatenates a ``DecoderLayer``'s q|k|v projections into one
[(Hq + 2 Hkv) * D, H] weight and gate|up into one [2I, H] weight, then points
the original parameters at row slices of the fused tensors: the checkpoints
are unchanged, no byte is held twice, and the reference modules keep working
on the same model. RMSNorm weights are not folded into the projections: the
GEMM prologue multiplies by them (the draft reads its K|V projection with
another norm than its layers' input norm).

``FastTarget`` / ``FastDraft`` are the target's and the draft's forward
passes written against an ops object (``TritonOps`` on CUDA, ``TorchOps``
anywhere): the graph modules of ``kernels.modules`` call them. ``fp8_layer``
and ``FastDraft(weights="fp8")`` hold the draft's products in fp8 (new tensors,
a scale per row: ``kernels.quant``); the ops then take ``scale=``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dflash_trt.export.draft import DraftModel
from dflash_trt.export.layers import DecoderLayer
from dflash_trt.export.target import TargetModel
from dflash_trt.runtime.kernels.quant import check_draft_weights, fp8_rows


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's tensors as the fast kernels read them."""

    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]: q_proj | k_proj | v_proj rows
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, Hq * D]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2I, H]: gate_proj | up_proj rows
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: int
    # fp8 weights (``fp8_layer``): each product's scale per output row [rows] fp32; None: weights in the model's dtype
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @property
    def kv(self) -> torch.Tensor:
        """[2 Hkv * D, H]: the k|v rows alone (the draft's context projection)."""
        return self.qkv[self.heads * self.head_dim :]

    @property
    def kv_bias(self) -> torch.Tensor | None:
        return None if self.qkv_bias is None else self.qkv_bias[self.heads * self.head_dim :]

    @property
    def kv_scale(self) -> torch.Tensor | None:
        return None if self.qkv_scale is None else self.qkv_scale[self.heads * self.head_dim :]


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of ``tensors`` as one view when they already lie back to back in one storage (fused before)."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.as_strided(shape, first.stride(), first.storage_offset())


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several nn.Linear; each module's parameters become views into it.

    Idempotent: parameters fused by an earlier backend over the same model are reused, not copied again.
    """
    weights = [m.weight.detach() for m in linears]
    biases = None if linears[0].bias is None else [m.bias.detach() for m in linears]
    weight = _adjacent(weights)
    bias = None if biases is None else _adjacent(biases)
    if weight is not None and (biases is None or bias is not None):
        return weight, bias
    weight = torch.cat(weights)
    bias = None if biases is None else torch.cat(biases)
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = weight[row : row + rows]
        if bias is not None:
            m.bias.data = bias[row : row + rows]
        row += rows
    return weight, bias


def fuse_layer(layer: DecoderLayer) -> FusedLayer:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    return FusedLayer(
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=attn.o_proj.weight.detach(),
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        down=mlp.down_proj.weight.detach(),
        down_bias=None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach(),
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach(),
        k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach(),
        eps=layer.input_layernorm.eps,
        heads=attn.heads,
        kv_heads=attn.kv_heads,
        head_dim=attn.head_dim,
        causal=layer.causal,
        window=layer.window,
    )


def fp8_layer(layer: FusedLayer) -> FusedLayer:
    """The layer with its four products' weights in fp8, a scale per output row (``kernels.quant.fp8_rows``);
    norms and biases unchanged. New tensors: the model's own weights are left as they are."""
    qkv, qkv_scale = fp8_rows(layer.qkv)
    o, o_scale = fp8_rows(layer.o)
    gate_up, gate_up_scale = fp8_rows(layer.gate_up)
    down, down_scale = fp8_rows(layer.down)
    return replace(layer, qkv=qkv, qkv_scale=qkv_scale, o=o, o_scale=o_scale, gate_up=gate_up, gate_up_scale=gate_up_scale,
                   down=down, down_scale=down_scale)


def supported(target: TargetModel, draft: DraftModel) -> str | None:
    """Why the fast kernels cannot run this pair (None: they can)."""
    for name, config in (("target", target.config), ("draft", draft.config)):
        d = config.head_dim
        if d < 16 or d > 256 or d & (d - 1):
            return f"{name} head_dim must be a power of two in [16, 256], got {d}"
    return None


class FastLayers:
    """Decoder layers over fused weights (shared by the target and the draft); ``fp8``: their products' weights in
    fp8 (``fp8_layer``: the draft's, never the target's)."""

    def __init__(self, layers, inv_freq: torch.Tensor, ops, fp8: bool = False) -> None:
        self.layers = [fuse_layer(layer) for layer in layers]
        if fp8:
            self.layers = [fp8_layer(layer) for layer in self.layers]
        self.inv_freq = inv_freq.float()
        self.ops = ops

    def layer(self, index: int, x, start, tokens, positions, kv_len, k_cache, v_cache, tap=None, rows=None, lengths=None) -> torch.Tensor:
        """x [n*T, H] (updated in place) at positions [n, T]; writes K/V at slots start..; returns x.

        ``rows`` None: the caches are the owners' rows; else [n] rows of whole pools (a device input).
        ``lengths`` [n]: owner i writes K/V of its first lengths[i] rows only (a padded ragged batch)."""
        L, ops = self.layers[index], self.ops
        n = x.shape[0] // tokens
        qkv = ops.linear(x, L.qkv, bias=L.qkv_bias, norm=L.input_norm, eps=L.eps, scale=L.qkv_scale)
        q = ops.qk_rope_write(
            qkv, start, tokens, L.heads, L.kv_heads, L.head_dim, L.q_norm, L.k_norm, L.eps, self.inv_freq, k_cache, v_cache, rows, lengths
        )  # [n, T, Hq, D]
        attended = ops.attention(q.transpose(1, 2), k_cache, v_cache, rows, positions, kv_len, L.causal, L.window)
        attended = attended.transpose(1, 2).reshape(n * tokens, L.heads * L.head_dim)
        x = ops.linear(attended, L.o, bias=L.o_bias, residual=x, out=x, scale=L.o_scale)
        h = ops.linear(x, L.gate_up, bias=L.gate_up_bias, norm=L.post_norm, eps=L.eps, gated=True, scale=L.gate_up_scale)
        return ops.linear(h, L.down, bias=L.down_bias, residual=x, out=x, tap=tap, scale=L.down_scale)


class FastTarget:
    """``TargetModel.features`` / ``head`` on fused weights."""

    def __init__(self, target: TargetModel, ops) -> None:
        config = target.config
        self.stack = FastLayers(target.model.layers, target.rotary.inv_freq, ops)
        self.ops, self.hidden = ops, config.hidden_size
        self.embedding = target.model.embed_tokens.weight.detach()
        self.norm, self.eps = target.model.norm.weight.detach(), target.model.norm.eps
        self.lm_head = target.lm_head.weight.detach()
        self.taps = {layer: slot for slot, layer in enumerate(sorted(set(target.tap_layers)))}  # layer order, like features()
        # TargetModel.tap_of (HF hidden_states[i + 1]) where the model defines it: inner taps are residuals.
        self.tap_of = getattr(target, "tap_of", None)

    def features(self, tokens: torch.Tensor, start: torch.Tensor, keys, values, rows=None, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [n, T] -> residual stream after the last layer [n*T, H] (not normed), taps [n, T, m*H].

        ``rows``, ``lengths``: as ``FastLayers.layer`` (whole pools; a padded ragged batch)."""
        n, T = tokens.shape
        x, positions, kv_len = self.ops.embed(self.embedding, start, tokens)  # x [n*T, H]: a fresh tensor updated in place
        if lengths is not None:  # padded rows never widen what the real rows (or anyone) read
            kv_len = start + lengths
        taps = x.new_empty(n * T, len(self.taps) * self.hidden)
        last = len(self.stack.layers) - 1
        for index in range(len(self.stack.layers)):
            slot = self.taps.get(index)
            tap = None if slot is None or index == last else self._tap(taps, slot)
            x = self.stack.layer(index, x, start, T, positions, kv_len, keys[index], values[index], tap, rows, lengths)
        if last in self.taps:  # the last layer's tap as the reference model defines it (final-normed, with tap_of)
            self._tap(taps, self.taps[last]).copy_(self.tap_of(last, x) if self.tap_of is not None else x)
        return x, taps.view(n, T, -1)

    def _tap(self, taps: torch.Tensor, slot: int) -> torch.Tensor:
        return taps[:, slot * self.hidden : (slot + 1) * self.hidden]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Residual rows [M, H] -> fp32 logits [M, V] of the final norm (``TargetModel.head``)."""
        return self.ops.linear(x, self.lm_head, norm=self.norm, eps=self.eps, out_dtype=torch.float32)


class FastDraft:
    """The draft's context write and block forward on fused weights (embedding and head: the target's).

    ``weights="fp8"``: every product of the draft in fp8 with a scale per output row (``kernels.quant``): its
    layers, ``fc`` and a copy of the target's LM head of its own (the target keeps its head). Half the bytes
    per draft launch; only the proposals can change (the target verifies every token)."""

    def __init__(self, draft: DraftModel, target: FastTarget, ops, weights: str = "model") -> None:
        config = draft.config
        fp8 = check_draft_weights(weights) == "fp8"
        self.stack = FastLayers(draft.layers, draft.rotary.inv_freq, ops, fp8=fp8)
        self.ops, self.target, self.config = ops, target, config
        self.fc, self.fc_scale = draft.fc.weight.detach(), None
        self.lm_head, self.lm_head_scale = target.lm_head, None
        if fp8:
            self.fc, self.fc_scale = fp8_rows(self.fc)
            self.lm_head, self.lm_head_scale = fp8_rows(target.lm_head)
        self.hidden_norm, self.norm = draft.hidden_norm.weight.detach(), draft.norm.weight.detach()
        self.eps = draft.norm.eps

    def write_context(self, taps: torch.Tensor, start: torch.Tensor, keys, values, rows=None, lengths=None) -> None:
        """taps [n, C, W] at positions start.. -> context K/V of every layer (``DraftModel.write_context``);
        ``lengths`` [n]: owner i's first lengths[i] rows only."""
        n, C, W = taps.shape
        context = self.ops.linear(taps.reshape(n * C, W), self.fc, scale=self.fc_scale)  # [n*C, H]; hidden_norm: in the K|V prologue
        for index, L in enumerate(self.stack.layers):
            kv = self.ops.linear(context, L.kv, bias=L.kv_bias, norm=self.hidden_norm, eps=self.eps, scale=L.kv_scale)
            self.ops.qk_rope_write(
                kv, start, C, 0, L.kv_heads, L.head_dim, None, L.k_norm, L.eps, self.stack.inv_freq, keys[index], values[index], rows,
                lengths,
            )

    def propose(self, anchor: torch.Tensor, start: torch.Tensor, proposals: int, keys, values, rows=None) -> torch.Tensor:
        """Block [anchor, MASK x (B-1)] at start.. -> argmax of the target head over slots 1..P [n, P]."""
        n, B, config = anchor.shape[0], self.config.block_size, self.config
        x, positions, kv_len = self.ops.embed(self.target.embedding, start, anchor=anchor, mask_id=config.mask_token_id, block=B,
                                              scale=config.embedding_scale)
        for index in range(len(self.stack.layers)):
            x = self.stack.layer(index, x, start, B, positions, kv_len, keys[index], values[index], rows=rows)
        # The head over every block row, slot 0 too: the proposal rows 1..P taken as a view afterwards, not
        # copied out first (a launch of its own; a row's logits do not depend on the rows beside it).
        logits = self.ops.linear(x, self.lm_head, norm=self.norm, eps=self.eps, scale=self.lm_head_scale)  # [n*B, V], model dtype
        return logits.view(n, B, -1)[:, 1 : proposals + 1].argmax(dim=-1)
