"""The contract graphs of the fast path: same inputs and outputs as ``export.graph_modules``' wrappers.

Each is a callable over ``FastTarget`` / ``FastDraft`` (fused weights, fast
ops) taking the contract's inputs positionally, caches last (the owners'
rows, written in place and returned). With the keyword ``rows`` [n] (a device
tensor) the caches are whole pools and owner i uses row rows[i]: one call (and
one CUDA graph) serves any set of rows. The verdict graphs have no weights and
keep their reference modules.

``draft_{n}`` writes the B context rows at ``ctx_start`` and then the block at
``ctx_start + ctx_count``: the same cache contents as the exported graph's
single window write (``export.graph_modules.ContextAndBlock``, a TensorRT constraint
that CUDA kernels do not share).
"""

from __future__ import annotations

import torch

from dflash_trt.export import contract as c
from dflash_trt.export.contract import Dims, GraphSpec
from dflash_trt.runtime.kernels.fused import FastDraft, FastTarget


def _caches(caches: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Interleaved (key_0, value_0, key_1, ...) -> (keys, values)."""
    return list(caches[0::2]), list(caches[1::2])


class FastTargetPrefill:
    """tokens [1, T], start [1], caches -> logits [1, V] fp32 (last row), taps [1, T, W], caches."""

    def __init__(self, target: FastTarget) -> None:
        self.target = target

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor, rows=None):
        x, taps = self.target.features(tokens, start, *_caches(caches), rows)
        return (self.target.head(x[-1:]), taps, *caches)


class FastTargetVerify:
    """tokens [n, P+1], start [n], caches -> logits [n, P+1, V] fp32, taps [n, P+1, W], caches."""

    def __init__(self, target: FastTarget) -> None:
        self.target = target

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor, rows=None):
        x, taps = self.target.features(tokens, start, *_caches(caches), rows)
        return (self.target.head(x).view(*tokens.shape, -1), taps, *caches)


class FastTargetDecode:
    """tokens [n, 1], start [n], caches -> logits [n, V] fp32, taps [n, 1, W], caches (plain decoding)."""

    def __init__(self, target: FastTarget) -> None:
        self.target = target

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor, rows=None):
        x, taps = self.target.features(tokens, start, *_caches(caches), rows)
        return (self.target.head(x), taps, *caches)


class FastDraftContext:
    """taps [1, C, W] at positions start.. -> the draft caches."""

    def __init__(self, draft: FastDraft) -> None:
        self.draft = draft

    def __call__(self, taps: torch.Tensor, start: torch.Tensor, *caches: torch.Tensor, rows=None):
        self.draft.write_context(taps, start, *_caches(caches), rows)
        return caches


class FastDraftBlock:
    """ctx_taps [n, B, W], ctx_start, ctx_count, anchor [n], caches -> proposals [n, P] int64, caches."""

    def __init__(self, draft: FastDraft, proposals: int) -> None:
        self.draft, self.proposals = draft, proposals

    def __call__(self, ctx_taps, ctx_start, ctx_count, anchor, *caches: torch.Tensor, rows=None):
        keys, values = _caches(caches)
        self.draft.write_context(ctx_taps, ctx_start, keys, values, rows)
        proposals = self.draft.propose(anchor, ctx_start + ctx_count, self.proposals, keys, values, rows)
        return (proposals, *caches)


PREFILL_MANY, DRAFT_CONTEXT_MANY = "target_prefill_many", "draft_context_many"  # ragged batches (not contract graphs)


class FastTargetPrefillMany:
    """tokens [n, T] (owner i's first lengths[i] real), start [n], lengths [n], caches, rows ->
    logits [n, V] fp32 of each owner's last real row, taps [n, T, W] (rows past lengths[i]: padding)."""

    def __init__(self, target: FastTarget) -> None:
        self.target = target

    def __call__(self, tokens, start, lengths, *caches: torch.Tensor, rows=None):
        n, T = tokens.shape
        x, taps = self.target.features(tokens, start, *_caches(caches), rows, lengths)
        last = x.view(n, T, -1)[torch.arange(n, device=x.device), lengths - 1]  # [n, H]
        return (self.target.head(last), taps, *caches)


class FastDraftContextMany:
    """taps [n, C, W] at positions start.. (owner i's first lengths[i] rows), caches, rows -> the draft caches."""

    def __init__(self, draft: FastDraft) -> None:
        self.draft = draft

    def __call__(self, taps, start, lengths, *caches: torch.Tensor, rows=None):
        self.draft.write_context(taps, start, *_caches(caches), rows, lengths)
        return caches


def fast_graph_modules(specs: dict[str, GraphSpec], target: FastTarget, draft: FastDraft, dims: Dims) -> dict:
    """The fast module of every graph with weights, by name (verdict graphs are not included), and the
    ragged-batch modules of batched prefill (``PREFILL_MANY``, ``DRAFT_CONTEXT_MANY``)."""
    builders = {
        c.TARGET_PREFILL: lambda: FastTargetPrefill(target),
        c.TARGET_VERIFY: lambda: FastTargetVerify(target),
        c.TARGET_DECODE: lambda: FastTargetDecode(target),
        c.DRAFT_CONTEXT: lambda: FastDraftContext(draft),
        c.DRAFT: lambda: FastDraftBlock(draft, dims.proposals),
    }
    modules = {name: builders[spec.kind]() for name, spec in specs.items() if spec.kind in builders}
    return modules | {PREFILL_MANY: FastTargetPrefillMany(target), DRAFT_CONTEXT_MANY: FastDraftContextMany(draft)}
