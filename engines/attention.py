"""Give every parsed ``IAttention`` the meaning of its ONNX ``Attention`` node.

TensorRT's ONNX parser (TensorRT-RTX 1.7; TensorRT 11) turns Attention-24
into an ``IAttention`` but

- drops ``nonpad_kv_seqlen``: the lengths tensor stays in the network, read
  by nothing, and the engine attends over the whole cache (stale slots too);
- reads ``is_causal=1`` as upper-left causal (query i sees key j iff j <= i),
  where ONNX aligns it lower-right (j <= i + kv_length - T): a query at
  position ``start + i`` of a cache must see every slot up to its own.

It also multiplies Q and the whole K cache by sqrt(scale) each (``IAttention``
has no scale), at any scale; ``fold_key_scale`` moves both factors onto Q.

``bind_attention`` restores both after parsing: every attention gets the
causal alignment its node asks for (``LOWER_RIGHT`` or ``NONE``) and, when
the node has ``nonpad_kv_seqlen``, that very tensor (cast to INT32, which
``IAttention`` requires) as ``key_value_lengths``. So the target's layers
are lower-right causal with lengths ``start + T``, the draft's non-causal
with lengths ``start + B``, and the build's unread-tensor check finds
nothing to refuse. Nodes with a mask keep it and get neither (exports never
give a node both, see ``export.onnx_kernels``).

Attention layers are matched to their nodes by output name: the parser
names each layer output after the ONNX tensor it produces.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

ATTENTION = "Attention"
NONPAD_KV_SEQLEN = 6  # input slot of ONNX Attention-24
MASK = 3
LOWER_RIGHT = "LOWER_RIGHT"
NO_CAUSALITY = "NONE"


@dataclass(frozen=True)
class AttentionNode:
    """What one ONNX Attention node asks for."""

    name: str
    output: str  # its output 0, the name of the parsed attention's output tensor
    causal: bool
    lengths: str  # the tensor fed to nonpad_kv_seqlen, "" when none
    mask: bool


@dataclass(frozen=True)
class BoundAttention:
    """One attention as the network computes it after ``bind_attention`` (recorded in engines.json)."""

    node: str
    causal: str  # CausalMaskKind member name
    lengths: str  # the graph tensor bound (through an INT32 cast) as key_value_lengths, "" when none
    mask: bool

    def to_json(self) -> dict:
        return {"node": self.node, "causal": self.causal, "lengths": self.lengths, "mask": self.mask}

    @classmethod
    def from_json(cls, data) -> BoundAttention:
        return cls(str(data["node"]), str(data["causal"]), str(data["lengths"]), bool(data["mask"]))


def attention_digest(records: Sequence[BoundAttention]) -> str:
    """sha256 of the records as engines.json writes them (order kept: graph order)."""
    text = json.dumps([r.to_json() for r in records], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def attention_tag(records: Sequence[BoundAttention]) -> str:
    """The network name a plan is built with: its attention's digest, stored in the plan (and so
    under the plan's hash) and reported back by the deserialized engine's ``name``."""
    return f"dflash-trt attention sha256:{attention_digest(records)}"


def record_problems(records: Sequence[BoundAttention]) -> list[str]:
    """Every record that is not an attention the build makes, naming its field: lower-right causal
    with key/value lengths (the target), non-causal with lengths (the draft), or a mask alone."""
    problems = []
    for index, r in enumerate(records):
        where = f"attention[{index}] (node {r.node!r})"
        if r.causal not in (LOWER_RIGHT, NO_CAUSALITY):
            problems.append(f"{where}.causal is {r.causal!r}; the build makes {LOWER_RIGHT!r} or {NO_CAUSALITY!r} only")
        elif r.mask and (r.lengths or r.causal != NO_CAUSALITY):
            problems.append(f"{where} has a mask with causal {r.causal!r} and lengths {r.lengths!r}; a mask comes with neither")
        elif not r.mask and not r.lengths:
            problems.append(f"{where}.lengths is empty and there is no mask: it would attend stale cache slots")
    return problems


def attention_nodes(model: onnx.ModelProto) -> list[AttentionNode]:
    """Every Attention node of a graph, in graph order."""
    nodes = []
    for node in model.graph.node:
        if node.op_type != ATTENTION or node.domain not in ("", "ai.onnx"):
            continue
        causal = any(a.name == "is_causal" and a.i for a in node.attribute)
        lengths = node.input[NONPAD_KV_SEQLEN] if len(node.input) > NONPAD_KV_SEQLEN else ""
        mask = len(node.input) > MASK and bool(node.input[MASK])
        nodes.append(AttentionNode(node.name, node.output[0], causal, lengths, mask))
    return nodes


class AttentionBindError(Exception):
    """One node whose attention could not be given its meaning: (node, message)."""

    def __init__(self, node: str, message: str):
        super().__init__(f"{node}: {message}")
        self.node, self.message = node, message


def bind_attention(trt, network, nodes: Sequence[AttentionNode], version: str = "") -> list[BoundAttention]:
    """Set causal alignment and key/value lengths of every node's IAttention and fold its key
    scaling into the query (``fold_key_scale``); raise ``AttentionBindError``."""
    attentions = parsed_attentions(trt, network)
    producers, readers = _producers_and_readers(network)
    for attention in attentions.values():
        fold_key_scale(trt, attention, producers, readers)
    tensors = network_tensors(network)
    casts: dict[str, object] = {}  # one INT32 cast per lengths tensor, shared by the layers that use it
    bound = []
    for node in nodes:
        attention = attentions.get(node.output)
        if attention is None:
            raise AttentionBindError(node.name, f"no IAttention in the parsed network produces {node.output!r}")
        if (node.causal or node.lengths) and not hasattr(attention, "causal_kind"):
            msg = (
                f"TensorRT {version} cannot set an attention's causal alignment or key/value lengths "
                "(IAttention.causal_kind / key_value_lengths need TensorRT >= 11.0 or TensorRT-RTX >= 1.7): "
                "export with --causal mask for this TensorRT"
            )
            raise AttentionBindError(node.name, msg)
        if node.causal:
            _set(attention, "causal_kind", trt.CausalMaskKind.LOWER_RIGHT, node)
        if node.lengths and attention.key_value_lengths is None:
            source = tensors.get(node.lengths)
            if source is None:
                raise AttentionBindError(node.name, f"its nonpad_kv_seqlen {node.lengths!r} is not a tensor of the parsed network")
            if node.lengths not in casts:
                cast = network.add_cast(source, trt.int32)  # IAttention takes INT32 lengths only
                cast.name = f"{node.lengths}/int32_key_value_lengths"
                casts[node.lengths] = cast.get_output(0)
            _set(attention, "key_value_lengths", casts[node.lengths], node)
        has_lengths = getattr(attention, "key_value_lengths", None) is not None
        bound.append(BoundAttention(node.name, _causal_name(attention), node.lengths if has_lengths else "", node.mask))
    return bound


def fold_key_scale(trt, attention, producers: dict, readers: dict) -> bool:
    """Scale the query by the whole softmax scale instead of query and keys by its square root each.

    ``IAttention`` has no scale: the parser multiplies Q and K by sqrt(scale) before it (also
    at scale 1), and K is the whole cache, [n, Hkv, L, D], so that product is a pass over the
    cache per layer and step unless the builder fuses it. Rewired here: the K-side product
    computes the scalar ``sqrt(scale) * sqrt(scale)`` from the two factors, the Q-side one
    multiplies Q by it, and the attention reads the cache as it is. The parser's own factors,
    the same math, nothing left unread. Only the parser's exact pattern is rewired (each input a
    PROD of a tensor and a [1, 1, 1, 1] factor, read by this attention alone); anything else
    stays as parsed (False).
    """
    if not hasattr(attention, "set_input"):  # a TensorRT whose IAttention cannot be rewired
        return False
    q_scale = _scaling(trt, attention.get_input(0), producers, readers)
    k_scale = _scaling(trt, attention.get_input(1), producers, readers)
    if q_scale is None or k_scale is None:
        return False
    keys = k_scale.get_input(0)
    k_scale.set_input(0, q_scale.get_input(1))  # now factor_q * factor_k: [1, 1, 1, 1]
    q_scale.set_input(1, k_scale.get_output(0))
    attention.set_input(1, keys)
    return True


def _scaling(trt, tensor, producers: dict, readers: dict):
    """The parser's ``tensor = x * factor`` layer (factor [1, 1, 1, 1]) if ``tensor`` is one, read once; else None."""
    layer = producers.get(tensor.name)
    if layer is None or layer.type != trt.LayerType.ELEMENTWISE or layer.num_inputs != 2 or readers.get(tensor.name) != 1:
        return None
    layer.__class__ = trt.IElementWiseLayer  # TensorRT's Python idiom for a layer's subclass
    if layer.op != trt.ElementWiseOperation.PROD or tuple(layer.get_input(1).shape) != (1, 1, 1, 1):
        return None
    return layer


def _producers_and_readers(network) -> tuple[dict, dict]:
    """Tensor name -> the layer producing it; tensor name -> how many layers (and network outputs) read it."""
    producers, readers = {}, {}
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        producers.update((layer.get_output(j).name, layer) for j in range(layer.num_outputs))
        for j in range(layer.num_inputs):
            if layer.get_input(j) is not None:
                readers[layer.get_input(j).name] = readers.get(layer.get_input(j).name, 0) + 1
    for index in range(network.num_outputs):
        readers[network.get_output(index).name] = readers.get(network.get_output(index).name, 0) + 1
    return producers, readers


def _set(attention, field: str, value, node: AttentionNode) -> None:
    try:
        setattr(attention, field, value)
    except (RuntimeError, TypeError) as error:
        raise AttentionBindError(node.name, f"TensorRT refused IAttention.{field} = {value}: {error}") from error


def _causal_name(attention) -> str:
    kind = getattr(attention, "causal_kind", None)
    if kind is None:  # TensorRT before 11: a bool that means upper-left
        return "UPPER_LEFT" if attention.causal else NO_CAUSALITY
    return kind.name


def parsed_attentions(trt, network) -> dict[str, object]:
    """Output tensor name -> the IAttention of every ATTENTION_OUTPUT layer."""
    found = {}
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if layer.type == trt.LayerType.ATTENTION_OUTPUT:
            layer.__class__ = trt.IAttentionOutputLayer  # TensorRT's Python idiom for a layer's subclass
            found[layer.get_output(0).name] = layer.attention
    return found


def network_tensors(network) -> dict[str, object]:
    """Every tensor of a network by name: its inputs and each layer's outputs."""
    tensors = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        tensors.update((layer.get_output(j).name, layer.get_output(j)) for j in range(layer.num_outputs))
    return tensors
