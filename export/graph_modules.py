"""One ``nn.Module`` per graph kind: exactly the contract's tensors, in contract order.

These wrappers are what ``torch.onnx.export`` traces (with ``OnnxKernels`` on
the models) and what the runtime's torch backend runs eagerly (with
``EagerKernels``: the caches are then updated in place and the returned
``present_*`` tensors ARE the ``past_*`` inputs). Inputs are positional:
the contract's named inputs, then the caches as ``past_key_0, past_value_0,
past_key_1, ...``; outputs are a tuple in the contract's output order.

Cache inputs are the owners' rows: owner i is batch index i, i.e. cache row i
of the bound view, so every wrapper runs its models with ``rows=None`` (no row gather).
"""

from __future__ import annotations

from typing import Self

import torch
from torch import nn

from dflash_trt.export import contract
from dflash_trt.export.contract import Dims, GraphSpec
from dflash_trt.export.draft import DraftModel
from dflash_trt.export.sampling import choose_op, verdict
from dflash_trt.export.target import TargetModel


def _caches(caches: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Interleaved (key_0, value_0, key_1, ...) -> (keys, values)."""
    return list(caches[0::2]), list(caches[1::2])


def _interleave(keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(t for pair in zip(keys, values) for t in pair)


def _owners(batch: torch.Tensor) -> None:
    """The caches a wrapper sees ARE the owners' rows (row i = owner i): no row index needed."""
    return None


class _TargetGraph(nn.Module):
    """A graph over the target model alone (its caches are the target pool's)."""

    @classmethod
    def build(cls, target: TargetModel, draft: DraftModel, dims: Dims) -> Self:
        return cls(target)

    def __init__(self, target: TargetModel) -> None:
        super().__init__()
        self.target = target


class TargetPrefill(_TargetGraph):
    """tokens [1, T], start [1], caches -> logits [1, V] fp32 (last row), taps [1, T, W], caches.

    Prompt chunks, replays and plain one-token decode.
    """

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor):
        keys, values = _caches(caches)
        hidden, taps = self.target.features(tokens, start, _owners(tokens), keys, values)
        return (self.target.head(hidden[:, -1]), taps, *_interleave(keys, values))


class TargetDecode(TargetPrefill):
    """tokens [n, 1], start [n], caches -> logits [n, V] fp32, taps [n, 1, W], caches.

    Plain decoding, one token per owner: the prefill computation at a static
    owner count, so it can be captured and batched like the verify graphs.
    """


class TargetNetwork(_TargetGraph):
    """tokens [N, S], start [N], picks [Q], caches -> logits [N, Q, V] fp32 (rows ``picks`` of every
    owner), taps [N, S, W], caches: the ``target_model`` that computes every target run graph."""

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, picks: torch.Tensor, *caches: torch.Tensor):
        keys, values = _caches(caches)
        hidden, taps = self.target.features(tokens, start, _owners(tokens), keys, values)
        return (self.target.head(hidden.index_select(1, picks)), taps, *_interleave(keys, values))


class TargetVerify(_TargetGraph):
    """tokens [n, P+1] = [anchor, d_1..d_P], start [n], caches -> logits [n, P+1, V] fp32, taps, caches."""

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor):
        keys, values = _caches(caches)
        logits, taps = self.target(tokens, start, _owners(tokens), keys, values)
        return (logits, taps, *_interleave(keys, values))


class DraftContext(nn.Module):
    """taps [1, C, W] at positions start.. -> the draft caches (context K/V of every layer)."""

    @classmethod
    def build(cls, target: TargetModel, draft: DraftModel, dims: Dims) -> DraftContext:
        return cls(draft)

    def __init__(self, draft: DraftModel) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, taps: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor):
        keys, values = _caches(caches)
        self.draft.write_context(taps, start, _owners(taps), keys, values)
        return _interleave(keys, values)


class ContextAndBlock:
    """The single cache write of ``draft_model``: context rows and the block as ONE update.

    TensorRT's KV-cache update must feed a graph output directly, so a graph
    may write each cache once. The update spans the C+B slots ``first ..
    first+C+B-1``, ``first = min(ctx_start, L - C - B)`` (the exporter keeps
    C + B <= L), which cover the ``ctx_count`` context rows at ``ctx_start``
    and, when the block fits (``start + B <= L``), the block at ``start =
    ctx_start + ctx_count``; a row without a block (anchor < 0) writes its
    context only. Every other slot is rewritten with its own old value.
    """

    def __init__(self, ctx_start: torch.Tensor, ctx_count: torch.Tensor, has_block: torch.Tensor, rows: int, block: int, length: int) -> None:
        width = rows + block
        self.first = torch.clamp(ctx_start, max=length - width)  # [n]
        offsets = torch.arange(width, device=ctx_start.device)
        slots = self.first[:, None] + offsets  # [n, C+B]
        ctx, begin = ctx_start[:, None], (ctx_start + ctx_count)[:, None]
        in_block = (slots >= begin) & (slots < begin + block) & has_block[:, None]
        # Index into [old window (C+B) ; context rows (C) ; block (B)] for each slot.
        self.pick = torch.where(
            (slots >= ctx) & (slots < begin),
            width + slots - ctx,
            torch.where(in_block, width + rows + slots - begin, offsets),
        )
        self.slots = slots

    def write(self, kernels, cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor):
        """cache [n, H, L, D]; new [n, H, C+B, D] = [context rows ; block] -> the written cache."""
        def expand(index: torch.Tensor) -> torch.Tensor:  # [n, C+B] -> [n, H, C+B, D]
            return index[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3])

        old = torch.gather(cache, 2, expand(self.slots))
        source = torch.cat([old, new.to(cache.dtype)], dim=2)
        return kernels.write_cache(cache, rows, self.first, torch.gather(source, 2, expand(self.pick)))


class Draft(nn.Module):
    """ctx_taps [n, C, W], ctx_start, ctx_count, anchor [n], caches -> proposals [n, P] int64, caches.

    ``draft_{n}`` (C = B) and the ``draft_model`` that computes every draft run
    graph. Equals ``DraftModel.write_context`` of the ``ctx_count`` real rows
    followed by ``ReferenceDecoder._propose``: the block ``[anchor, MASK ×
    (B-1)]`` runs at ``start = ctx_start + ctx_count``. It is
    ``DraftModel.forward`` with the context write fused into each layer's
    block write (``ContextAndBlock``), and the context rows' K/V projected
    with the block's in one product per layer (a weight read by two products
    is stored twice by TensorRT-RTX: ~90 MB at the 8B width). An owner whose anchor is negative
    (``contract.NO_ANCHOR``: ``draft_context``) gets its context rows only;
    its proposals mean nothing. Holds the target for its embedding and LM head only.
    """

    @classmethod
    def build(cls, target: TargetModel, draft: DraftModel, dims: Dims) -> Draft:
        return cls(target, draft, dims.proposals)

    def __init__(self, target: TargetModel, draft: DraftModel, proposals: int) -> None:
        super().__init__()
        self.target, self.draft, self.proposals = target, draft, proposals

    def forward(
        self,
        ctx_taps: torch.Tensor,
        ctx_start: torch.Tensor,
        ctx_count: torch.Tensor,
        anchor: torch.Tensor,
        *caches: torch.Tensor,
    ):
        keys, values = _caches(caches)
        draft, config, kernels = self.draft, self.draft.config, self.draft.kernels
        rows, block, length = _owners(anchor), config.block_size, keys[0].shape[2]
        start = ctx_start + ctx_count
        context_rows = ctx_taps.shape[1]
        write = ContextAndBlock(ctx_start, ctx_count, anchor >= 0, context_rows, block, length)
        c = draft.context_features(ctx_taps)  # [n, C, H]
        masks = torch.full((anchor.shape[0], block - 1), config.mask_token_id, device=anchor.device)
        x = self.target.embed(torch.cat([anchor.clamp(min=0)[:, None], masks], dim=1))  # [n, B, H]
        if config.embedding_scale != 1.0:
            x = x * config.embedding_scale
        positions = start[:, None] + torch.arange(block, device=start.device)  # [n, B]
        context_positions = ctx_start[:, None] + torch.arange(context_rows, device=start.device)  # [n, C]
        cos, sin = draft.rotary(torch.cat([context_positions, positions], dim=1), x.dtype)  # [n, 1, C+B, D]
        block_cos, block_sin = cos[:, :, context_rows:], sin[:, :, context_rows:]
        # A block that does not fit (draft_context near the end of the cache) attends what there is.
        lengths = torch.clamp(start + block, max=length)
        for index, layer in enumerate(draft.layers):  # DecoderLayer.forward, one write per cache
            h = layer.input_layernorm(x)
            q = layer.self_attn.query(h, block_cos, block_sin)
            k, v = layer.self_attn.key_value(torch.cat([c, h], dim=1), cos, sin)  # [n, Hkv, C+B, D]
            keys[index] = write.write(kernels, keys[index], rows, k)
            values[index] = write.write(kernels, values[index], rows, v)
            attended = kernels.attention(q, keys[index], values[index], rows, positions, lengths, False, 0)
            x = x + layer.self_attn.output(attended)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = draft.norm(x)
        proposals = self.target.head(hidden[:, 1 : self.proposals + 1]).argmax(dim=-1)
        return (proposals, *_interleave(keys, values))


class VerifyArgmax(nn.Module):
    """logits [n, P+1, V] fp32, candidates [n, P+1] -> accepted [n], next_token [n] (greedy)."""

    @classmethod
    def build(cls, target: TargetModel, draft: DraftModel, dims: Dims) -> VerifyArgmax:
        return cls()

    def forward(self, logits: torch.Tensor, candidates: torch.Tensor):
        return verdict(candidates[:, 1:], logits.argmax(dim=-1))


class VerifySample(nn.Module):
    """logits, candidates, temperature/top_k/top_p [n], seed [n, 3], position [n] -> accepted, next_token.

    Row j of owner i chooses the target's token at position ``position[i] + j``
    with ``sampling.choose``, the reference decoder's choice, so sampled output
    stays lossless and reproducible.
    """

    @classmethod
    def build(cls, target: TargetModel, draft: DraftModel, dims: Dims) -> VerifySample:
        return cls()

    def forward(
        self,
        logits: torch.Tensor,
        candidates: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        seed: torch.Tensor,
        position: torch.Tensor,
    ):
        n, rows, vocab = logits.shape

        def per_row(x: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [n * rows, ...]
            return x[:, None].expand(n, rows, *x.shape[1:]).reshape(n * rows, *x.shape[1:])

        positions = (position[:, None] + torch.arange(rows, device=position.device)).reshape(n * rows)
        params = (per_row(temperature), per_row(top_k), per_row(top_p), per_row(seed))
        choices = choose_op(logits.reshape(n * rows, vocab), *params, positions)
        return verdict(candidates[:, 1:], choices.reshape(n, rows))


class Sample(nn.Module):
    """logits [R, V], temperature/top_k/top_p [R], seed [R, 3], position [R] -> token [R]: ``sampling.choose``.

    The runtime's choice after a prompt or replay (and any other single
    choice), so every token a backend emits comes from a graph of this one
    definition.
    """

    @classmethod
    def build(cls, target: TargetModel, draft: DraftModel, dims: Dims) -> Sample:
        return cls()

    def forward(self, logits, temperature, top_k, top_p, seed, position):
        return (choose_op(logits, temperature, top_k, top_p, seed, position),)


WRAPPERS: dict[str, type[nn.Module]] = {
    contract.TARGET_PREFILL: TargetPrefill,
    contract.TARGET_VERIFY: TargetVerify,
    contract.TARGET_DECODE: TargetDecode,
    contract.DRAFT_CONTEXT: DraftContext,
    contract.DRAFT: Draft,
    contract.VERIFY_ARGMAX: VerifyArgmax,
    contract.VERIFY_SAMPLE: VerifySample,
    contract.SAMPLE: Sample,
    contract.TARGET_MODEL: TargetNetwork,
    contract.DRAFT_MODEL: Draft,
}


def graph_module(spec: GraphSpec, target: TargetModel, draft: DraftModel, dims: Dims) -> nn.Module:
    """The wrapper that computes ``spec``, sharing the given models' weights."""
    return WRAPPERS[spec.kind].build(target, draft, dims)
