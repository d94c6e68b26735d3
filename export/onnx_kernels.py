"""Export-time cache kernels: ONNX ``TensorScatter`` and ``Attention`` (opset 24).

``OnnxKernels`` has ``EagerKernels``' two methods. While ``torch.onnx.export``
traces, each call emits one standard-domain node through
``torch.onnx.ops.symbolic``; otherwise it runs a PyTorch model of that node's
ONNX semantics (``tensor_scatter`` / ``onnx_attention``), so a module wired to
``OnnxKernels`` still runs eagerly and the formulation can be held against
``EagerKernels`` without ONNX Runtime.

The graphs address the owners' cache rows directly (``rows == arange(n)``:
the runtime binds a view of n consecutive rows), so ``rows`` is not used.

Validity is expressed as lengths (``nonpad_kv_seqlen = start + T``):

- draft block attention: non-causal over slots ``< start + B``: lengths only.
- target, ``causal="lengths"`` (default): ``is_causal=1`` with the lengths.
  ONNX (>= 1.23 errata) aligns that mask bottom-right: query i sees key j iff
  ``j <= i + nonpad_kv_seqlen - T`` = its own position, which is what the
  target needs. ONNX Runtime 1.32 implements it (tests check).
- ``causal="mask"``: every attention gets an explicit mask instead (boolean
  visibility from positions, passed as a float 0 / lowest-value mask added to
  the scores, see ``additive``): ``[n, 1, T, L]`` causal (+ window) for the target,
  ``[n, 1, T, L]`` of the length for the draft. Slower (the mask spans
  max_context) but needs neither the lengths nor the bottom-right reading of
  ``is_causal``, for backends that support neither. Sliding-window layers
  always take the mask.

An Attention with a mask gets no ``nonpad_kv_seqlen``: the mask already says
everything, and a lengths input a backend does not read would be a tensor its
engine silently drops (the engine build refuses those). TensorRT's ONNX parser
ignores ``nonpad_kv_seqlen`` and reads ``is_causal`` top-left;
``engines.attention`` restores both on the parsed network.

``TRANSLATIONS`` lowers ``torch.ops.dflash_trt.choose`` (the sampling graphs'
token choice, ``export.sampling``) by running the same math over ``OnnxOps``:
standard ONNX nodes, int64 Mul/Add/Mod for the hash, one TopK of
K <= 3840, no sort, no cumulative sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

OPSET = 24
CAUSAL_LENGTHS = "lengths"
CAUSAL_MASK = "mask"
CAUSAL_MODES = (CAUSAL_LENGTHS, CAUSAL_MASK)
SEQUENCE_AXIS = 2  # of a [n, kv_heads, max_context, head_dim] cache


def tensor_scatter(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """ONNX TensorScatter (mode linear, axis 2) in PyTorch: a new cache with
    ``update[i, :, t]`` at slot ``write_indices[i] + t`` of row i."""
    out = cache.clone()
    slots = write_indices[:, None] + torch.arange(update.shape[2], device=update.device)  # [n, T]
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    out[rows, :, slots] = update.transpose(1, 2).to(cache.dtype)
    return out


def onnx_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    nonpad_kv_seqlen: torch.Tensor | None,
    is_causal: bool,
) -> torch.Tensor:
    """ONNX Attention-24 (4-D, GQA, external cache) in PyTorch: q [n, Hq, T, D],
    k/v [n, Hkv, L, D], mask (boolean, or float added to the scores) broadcastable
    to [n, Hq, T, L] -> [n, Hq, T, D]. No ``nonpad_kv_seqlen``: every slot is valid."""
    n, _, tokens, _ = q.shape
    slots = torch.arange(k.shape[2], device=q.device)
    if nonpad_kv_seqlen is None:
        nonpad_kv_seqlen = torch.full((n,), k.shape[2], dtype=torch.int64, device=q.device)
    visible = slots[None, None, :] < nonpad_kv_seqlen[:, None, None]  # [n, 1, L]
    if is_causal:
        offset = nonpad_kv_seqlen - tokens  # bottom-right alignment
        last = torch.arange(tokens, device=q.device)[None, :, None] + offset[:, None, None]  # [n, T, 1]
        visible = visible & (slots <= last)
    visible = visible.expand(n, tokens, k.shape[2])[:, None]  # [n, 1, T, L]
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    if mask is not None:
        bias = bias + mask if mask.is_floating_point() else bias.masked_fill(~mask, float("-inf"))
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility -> float mask added to the scores: 0 or the dtype's lowest value.

    TensorRT-RTX 1.7 fails to compile a bf16 Attention whose boolean mask
    depends on a dynamic token count (duplicate Myelin op names); the float
    form builds, and a finite floor keeps fused kernels away from -inf - -inf.
    """
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visible.device))


def causal_mask(q_positions: torch.Tensor, max_context: int, window: int) -> torch.Tensor:
    """q_positions [n, T] -> boolean [n, 1, T, L]: slot j visible iff j <= p (and p - j < window)."""
    slots = torch.arange(max_context, device=q_positions.device)
    p = q_positions[..., None]  # [n, T, 1]
    visible = slots <= p
    if window:
        visible = visible & (p - slots < window)
    return visible[:, None]


def length_mask(kv_len: torch.Tensor, tokens: int, max_context: int) -> torch.Tensor:
    """kv_len [n] -> boolean [n, 1, T, L]: slot j visible iff j < kv_len.

    Materialized over T: ONNX Runtime does not broadcast the mask's query axis."""
    slots = torch.arange(max_context, device=kv_len.device)
    return (slots < kv_len[:, None])[:, None, None, :].expand(kv_len.shape[0], 1, tokens, max_context)


class OnnxKernels:
    """The cache kernels as ONNX nodes; see the module docstring for the formulation."""

    def __init__(self, causal: str = CAUSAL_LENGTHS, emit: bool = False) -> None:
        """``emit``: trace ONNX nodes even outside ``torch.onnx.export`` (the
        exporter traces with ``torch.export`` first, where the flag is unset)."""
        if causal not in CAUSAL_MODES:
            raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
        self.causal, self.emit = causal, emit

    def _emitting(self) -> bool:
        return self.emit or torch.onnx.is_in_onnx_export()

    def write_cache(
        self, cache: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, new: torch.Tensor
    ) -> torch.Tensor:
        """cache [n, H, L, D] (the owners' rows); start [n]; new [n, H, T, D] -> the updated cache."""
        new = new.to(cache.dtype)
        if not self._emitting():
            return tensor_scatter(cache, new, start)
        return torch.onnx.ops.symbolic(
            "TensorScatter",
            (cache, new, start),
            {"axis": SEQUENCE_AXIS, "mode": "linear"},
            dtype=cache.dtype,
            shape=cache.shape,
            version=OPSET,
        )

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
        """q [n, Hq, T, D] over the owners' cache rows -> [n, Hq, T, D].

        With ``causal``, queries must sit at ``kv_len - T ..`` (the target's
        layout), which the bottom-right ``is_causal`` relies on.
        """
        max_context = k_cache.shape[SEQUENCE_AXIS]
        mask = None
        if causal and (window or self.causal == CAUSAL_MASK):
            mask = causal_mask(q_positions, max_context, window)
        elif not causal and self.causal == CAUSAL_MASK:
            mask = length_mask(kv_len, q.shape[2], max_context)
        is_causal = causal and mask is None
        lengths = kv_len if mask is None else None  # a mask says it all: no lengths to drop
        if mask is not None:
            mask = additive(mask, q.dtype)
        if not self._emitting():
            return onnx_attention(q, k_cache, v_cache, mask, lengths, is_causal)
        return torch.onnx.ops.symbolic(
            "Attention",
            (q, k_cache, v_cache, mask, None, None, lengths),
            {"is_causal": int(is_causal)},
            dtype=q.dtype,
            shape=q.shape,
            version=OPSET,
        )


class OnnxOps:
    """``sampling.TorchPrimitives``' primitives as ONNX nodes (onnxscript, inside ``torch.onnx.export``).

    Python constants in the shared math become constants of the other
    operand's dtype (the exporter binds them by the op's type constraint).
    """

    def __init__(self) -> None:
        from onnxscript import opset23 as op

        self.op = op

    def column(self, x, i: int):
        return self.op.Slice(x, [i], [i + 1], [1])

    def as_column(self, x):
        return self.op.Unsqueeze(x, [1])

    def tokens(self, like, vocab: int):
        return self.op.Unsqueeze(self.op.Range(0, vocab, 1), [0])  # [1, V] int64

    def to_float(self, x):
        return self.op.Cast(x, to=1)  # FLOAT

    def log(self, x):
        return self.op.Log(x)

    def exp(self, x):
        return self.op.Exp(x)

    def equal(self, x, y):
        return self.op.Equal(x, y)

    def where(self, condition, x, y):
        return self.op.Where(condition, x, y)

    def either(self, x, y):
        return self.op.Or(x, y)

    def both(self, x, y):
        return self.op.And(x, y)

    def row_sum(self, x):
        return self.op.ReduceSum(x, [-1], keepdims=1)

    def top_values(self, x, k: int):
        values, _ = self.op.TopK(x, [k], axis=-1, largest=1, sorted=1)
        return values

    def pick(self, x, index):
        return self.op.GatherElements(x, index, axis=1)

    def clamp(self, x, low: int, high: int):
        return self.op.Clip(x, low, high)

    def argmax(self, x):
        return self.op.ArgMax(x, axis=-1, keepdims=0)  # select_last_index=0: first index on ties


def _choose(logits, temperature, top_k, top_p, seed, position):
    """torch.ops.dflash_trt.choose -> ``sampling.choose`` over ONNX ops."""
    from dflash_trt.export import sampling

    return sampling.choose(logits, temperature, top_k, top_p, seed, position, ops=OnnxOps())


def _translations() -> dict:
    from dflash_trt.export.sampling import choose_op

    return {choose_op._opoverload: _choose}


TRANSLATIONS = _translations()
