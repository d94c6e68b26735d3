"""Rewrites of a traced graph before it is saved: the same math, in forms ONNX Runtime runs faster.

- ``divide_by_root``: an RMSNorm traces as ``x * Reciprocal(Sqrt(v))``; written
  ``x / Sqrt(v)`` ONNX Runtime's optimizer fuses the whole norm into one
  ``SimplifiedLayerNormalization`` (the embedded pair's target: 525 nodes after
  its optimizer -> 327; each graph 4-7% faster on 2 CPU cores). Every export.
- ``live_keys``: ONNX Runtime's CPU ``Attention`` (1.32) reads every slot of
  the cache it is given, whatever ``nonpad_kv_seqlen`` says (the same time at
  64 or 1000 valid slots of 1024). Each Attention with lengths gets K and V
  sliced to the longest owner's length rounded up to ``KEY_ALIGN`` slots (at
  most the cache), so its work follows the context, not the capacity. Slots
  past a row's own length were masked before and are not read now: the
  result is unchanged. The slice's extent comes from a tensor, which a
  TensorRT engine cannot take (``engines.build`` refuses such graphs), so
  only exports for ONNX Runtime get it (``ExportOptions.live_keys``).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from dflash_trt.errors import ExportError

KEY_ALIGN = 16  # slots: the sliced cache's extent is a multiple (ONNX Runtime's buffers change size in these steps)
SEQUENCE_AXIS = 2  # of a [n, kv_heads, max_context, head_dim] cache
NONPAD_KV_SEQLEN = 6  # input slot of ONNX Attention-24
LIVE_KEYS_SLICE = "live_keys"  # name prefix of the nodes ``live_keys`` adds (what a graph viewer shows)


def divide_by_root(graph: ir.Graph) -> int:
    """Every ``Mul(x, Reciprocal(Sqrt(v)))`` -> ``Div(x, Sqrt(v))`` (where every use of the reciprocal is such a
    product); returns how many. A product that is a graph output keeps its name."""
    rewritten = 0
    for reciprocal in [n for n in graph if _is(n, "Reciprocal")]:
        inverse = reciprocal.outputs[0]
        root = reciprocal.inputs[0].producer() if reciprocal.inputs[0] is not None else None
        users = [use.node for use in inverse.uses()]
        if root is None or not _is(root, "Sqrt") or not users or inverse.is_graph_output():
            continue
        if not all(_is(m, "Mul") and list(m.inputs).count(inverse) == 1 for m in users):
            continue
        for mul in users:
            x = mul.inputs[1] if mul.inputs[0] is inverse else mul.inputs[0]
            divide = ir.Node("", "Div", [x, root.outputs[0]], name=f"{mul.name}_div")
            graph.insert_before(mul, divide)
            out = mul.outputs[0]
            out.replace_all_uses_with(divide.outputs[0], replace_graph_outputs=True)
            graph.remove(mul, safe=True)
            divide.outputs[0].name, divide.outputs[0].shape, divide.outputs[0].type = out.name, out.shape, out.type
            rewritten += 1
        graph.remove(reciprocal, safe=True)
    return rewritten


def live_keys(graph: ir.Graph) -> int:
    """K and V of every Attention with ``nonpad_kv_seqlen`` sliced to [.., :L, ..], L = min(max_context,
    max(lengths) rounded up to ``KEY_ALIGN``) (one L per lengths tensor, computed before its first use;
    max_context: the cache's static extent); returns the attentions sliced."""
    extents: dict[int, ir.Value] = {}
    sliced = 0
    for attention in [n for n in graph if _is(n, "Attention")]:
        lengths = attention.inputs[NONPAD_KV_SEQLEN] if len(attention.inputs) > NONPAD_KV_SEQLEN else None
        if lengths is None:
            continue  # a mask says which slots count; its extent is the cache's
        if id(lengths) not in extents:
            nodes = _extent(lengths, _capacity(attention), f"{LIVE_KEYS_SLICE}_{len(extents)}")
            graph.insert_before(attention, nodes)
            extents[id(lengths)] = nodes[-1].outputs[0]
        end = extents[id(lengths)]
        for slot, label in ((1, "k"), (2, "v")):
            zero, axis = _constant(f"{attention.name}_{label}_from", [0]), _constant(f"{attention.name}_{label}_axis", [SEQUENCE_AXIS])
            cut = ir.Node("", "Slice", [attention.inputs[slot], zero.outputs[0], end, axis.outputs[0]], name=f"{LIVE_KEYS_SLICE}_{attention.name}_{label}")
            graph.insert_before(attention, [zero, axis, cut])
            attention.replace_input_with(slot, cut.outputs[0])
        sliced += 1
    return sliced


def live_key_slices(model) -> list[str]:
    """The Attention nodes of an ONNX ``ModelProto`` whose K is read through a ``Slice`` (``live_keys``'s work)."""
    sliced = {node.output[0] for node in model.graph.node if node.op_type == "Slice" and node.domain in ("", "ai.onnx")}
    return [node.name for node in model.graph.node if node.op_type == "Attention" and len(node.input) > 1 and node.input[1] in sliced]


def _capacity(attention: ir.Node) -> int:
    """The static slot count of the cache ``attention`` reads (its K: [n, kv_heads, max_context, head_dim])."""
    shape = attention.inputs[1].shape
    extent = shape[SEQUENCE_AXIS] if shape is not None and len(shape) == 4 else None
    if not isinstance(extent, int):
        raise ExportError(f"attention {attention.name!r}: its cache's slot count must be static to slice it to the live keys, got shape {shape}")
    return extent


def _extent(lengths: ir.Value, max_context: int, name: str) -> list[ir.Node]:
    """Nodes computing [1] int64: min(max_context, ceil(max(lengths) / KEY_ALIGN) * KEY_ALIGN)."""
    step, below, cap = _constant(f"{name}_align", [KEY_ALIGN]), _constant(f"{name}_align_less_one", [KEY_ALIGN - 1]), _constant(f"{name}_cap", [max_context])
    longest = ir.Node("", "ReduceMax", [lengths], [ir.AttrInt64("keepdims", 1)], name=f"{name}_longest")
    padded = ir.Node("", "Add", [longest.outputs[0], below.outputs[0]], name=f"{name}_pad")
    blocks = ir.Node("", "Div", [padded.outputs[0], step.outputs[0]], name=f"{name}_blocks")
    rounded = ir.Node("", "Mul", [blocks.outputs[0], step.outputs[0]], name=f"{name}_rounded")
    end = ir.Node("", "Min", [rounded.outputs[0], cap.outputs[0]], name=f"{name}_end")
    return [step, below, cap, longest, padded, blocks, rounded, end]


def _constant(name: str, values: list[int]) -> ir.Node:
    return ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(values, dtype=np.int64), name=name))], name=name)


def _is(node: ir.Node, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")
