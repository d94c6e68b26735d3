"""The weights both models read, lifted out of their networks into one file (TensorRT sets).

TensorRT plans share no weights: built as exported, the draft's plan carries
its own copy of the target's embedding and LM head (2.49 GB at the Qwen3-8B
shape, 13.5% of the pair's weights). Before parsing, ``lift_shared_weights``
rewrites each model graph so that they are graph inputs
(``contract.SHARED_EMBEDDING``, ``contract.SHARED_HEAD``):

- the embedding: the data of the graph's one Gather over a [V, H] initializer;
- the head: the B operand of its one MatMul over an [H, V] initializer, or over
  ``Transpose(W)`` of a [V, H] one (a tied embedding), transposed here once so
  that no engine transposes V x H values per step.

The tensors go to ``shared_weights.safetensors`` beside the plans (recorded
with their sha256 in engines.json); the runtime reads that file once and binds
one device copy to every context of both engines (``read_shared_weights``).
Both models must read the same tensors — the draft's are the target's by
DFlash's definition — or the build is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from dflash_trt.engines.engine_set import SHARED_WEIGHTS_FILE, SharedWeightsRecord
from dflash_trt.engines.sources import GraphSource, load_graph
from dflash_trt.errors import EngineBuildError, EngineError
from dflash_trt.export import contract as c
from dflash_trt.export.contract import ONNX_ELEMENT_TYPES, TensorSpec
from dflash_trt.export.identity import file_sha256, file_stamp
from dflash_trt.export.torch_dtypes import TORCH_DTYPES

_DTYPE_NAMES = {element: name for name, element in ONNX_ELEMENT_TYPES.items()}


@dataclass(frozen=True)
class Use:
    """Where one model graph reads a shared weight: ``node``'s input ``slot`` reads
    ``initializer`` (through the Transpose node ``transpose`` when it is not None)."""

    node: onnx.NodeProto
    slot: int
    initializer: onnx.TensorProto
    transpose: onnx.NodeProto | None = None


@dataclass
class Lifted:
    """The rewritten model graphs (serialized, parsed with their original path so external
    weights resolve) and the shared tensors, in ``contract.SHARED_WEIGHTS`` order."""

    graphs: dict[str, bytes]  # model graph name -> rewritten ModelProto
    tensors: dict[str, torch.Tensor]  # host tensors, contiguous

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        return tensor_specs(self.tensors)


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    """Each tensor's name, shape and contract dtype name, in order."""
    dtypes = {dtype: name for name, dtype in TORCH_DTYPES.items()}
    return tuple(TensorSpec(name, tuple(t.shape), dtypes[t.dtype]) for name, t in tensors.items())


def lift_shared_weights(sources: Sequence[GraphSource]) -> Lifted | None:
    """Rewrite the model graphs among ``sources`` (none: None). The vocabulary V comes from
    ``target_model``'s logits, so a set with ``draft_model`` must have ``target_model``."""
    models = [s for s in sources if s.io.kind in c.MODEL_KINDS]
    if not models:
        return None
    target = next((s for s in models if s.io.kind == c.TARGET_MODEL), None)
    if target is None:
        raise EngineBuildError("draft_model is built with target_model: the two read the target's embedding and head from one shared file")
    vocab = next(s.shape[-1] for s in target.io.outputs if s.name == c.LOGITS)
    graphs, tensors = {}, None
    for source in models:
        model = load_graph(source.onnx_path)
        uses = {c.SHARED_EMBEDDING: embedding_use(model, vocab, source.name), c.SHARED_HEAD: head_use(model, vocab, source.name)}
        mine = {name: _tensor(use, source.onnx_path.parent) for name, use in uses.items()}
        if tensors is None:
            tensors = mine
        else:
            _check_same(tensors, mine, source.name)
        rewrite(model, uses, mine)
        graphs[source.name] = model.SerializeToString()
    return Lifted(graphs, tensors)


def embedding_use(model: onnx.ModelProto, vocab: int, graph: str) -> Use:
    """The one Gather (axis 0) whose data is a [V, H] initializer."""
    inits = _initializers(model)
    uses = [
        Use(node, 0, inits[node.input[0]])
        for node in model.graph.node
        if node.op_type == "Gather" and _axis(node) == 0 and node.input[0] in inits and _shape(inits[node.input[0]])[:1] == (vocab,)
        and len(_shape(inits[node.input[0]])) == 2
    ]
    return _one(uses, graph, f"Gather (axis 0) over a [{vocab}, H] embedding")


def head_use(model: onnx.ModelProto, vocab: int, graph: str) -> Use:
    """The one MatMul whose B is an [H, V] initializer, or Transpose(perm [1, 0]) of a [V, H] one."""
    inits = _initializers(model)
    transposes = {n.output[0]: n for n in model.graph.node if n.op_type == "Transpose" and _perm(n) in (None, [1, 0])}
    uses = []
    for node in model.graph.node:
        if node.op_type != "MatMul":
            continue
        operand = node.input[1]
        if operand in inits and len(_shape(inits[operand])) == 2 and _shape(inits[operand])[1] == vocab:
            uses.append(Use(node, 1, inits[operand]))
        elif operand in transposes and transposes[operand].input[0] in inits:
            weight = inits[transposes[operand].input[0]]
            if len(_shape(weight)) == 2 and _shape(weight)[0] == vocab:
                uses.append(Use(node, 1, weight, transposes[operand]))
    return _one(uses, graph, f"MatMul over an [H, {vocab}] head (or a transposed [{vocab}, H] one)")


def rewrite(model: onnx.ModelProto, uses: Mapping[str, Use], tensors: Mapping[str, torch.Tensor]) -> None:
    """In place: each use reads its graph input instead; the Transposes and initializers that
    nothing reads any more are removed; the inputs are declared after the graph's own."""
    graph = model.graph
    for name, use in uses.items():
        use.node.input[use.slot] = name
    transposes = {use.transpose.output[0] for use in uses.values() if use.transpose is not None}
    _keep(graph.node, lambda node: not (node.op_type == "Transpose" and node.output[0] in transposes and not _read(graph, node.output[0])))
    read = {name for node in graph.node for name in node.input}
    unread = {use.initializer.name for use in uses.values()} - read  # only what the rewrite stopped reading
    _keep(graph.initializer, lambda t: t.name not in unread)
    _keep(graph.input, lambda v: v.name not in unread)
    for spec in tensor_specs(tensors):
        graph.input.append(onnx.helper.make_tensor_value_info(spec.name, ONNX_ELEMENT_TYPES[spec.dtype], list(spec.shape)))


def _keep(field, keep) -> None:
    """Keep the items of a repeated protobuf field for which ``keep`` holds."""
    kept = [item for item in field if keep(item)]
    del field[:]
    field.extend(kept)


def write_shared_weights(out_dir: Path, lifted: Lifted) -> SharedWeightsRecord:
    """``shared_weights.safetensors`` in ``out_dir`` and its record (sha256 of the file as written)."""
    from safetensors.torch import save

    path = Path(out_dir) / SHARED_WEIGHTS_FILE
    data = save(lifted.tensors)  # in memory: hashed from there, and written with the plans' permissions
    path.write_bytes(data)
    return SharedWeightsRecord(path.name, hashlib.sha256(data).hexdigest(), len(data), lifted.specs)


def read_shared_weights(directory: Path, record: SharedWeightsRecord) -> dict[str, torch.Tensor]:
    """The shared tensors as host tensors, every one the record names with its shape and dtype and
    nothing else. The file is hashed in one streamed read, then parsed by safetensors from the page
    cache that read filled (``safetensors.torch.load`` of the bytes in memory copies them twice:
    8 s of 15 for the Qwen3-8B shape's 2.5 GB); a file that changes between the two is refused."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / record.file
    try:
        before = file_stamp(path)
        digest = file_sha256(path)
        with safe_open(str(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118  (a safe_open handle)
        changed = file_stamp(path) != before
    except OSError as error:
        raise EngineError(f"{path}: cannot be read ({type(error).__name__}: {error.strerror or error}); rebuild the set") from error
    except SafetensorError as error:
        raise EngineError(f"{path}: not a safetensors file ({error}); rebuild the set") from error
    if digest != record.sha256 or changed:
        why = "changed while it was read" if changed else f"has sha256 {digest}"
        raise EngineError(f"{path} {why}, engines.json records sha256 {record.sha256}: the file changed after the build; rebuild the set")
    have = tensor_specs(tensors)
    if sorted(have, key=lambda s: s.name) != sorted(record.tensors, key=lambda s: s.name):
        raise EngineError(f"{path}: holds {[s.to_json() for s in have]}, engines.json records {[s.to_json() for s in record.tensors]}; rebuild the set")
    return {s.name: tensors[s.name] for s in record.tensors}


def _tensor(use: Use, base: Path) -> torch.Tensor:
    """The shared tensor a use reads: the initializer's values, transposed when read through a Transpose."""
    tensor = _values(use.initializer, base)
    return tensor.t().contiguous() if use.transpose is not None else tensor


def _values(tensor: onnx.TensorProto, base: Path) -> torch.Tensor:
    dtype = TORCH_DTYPES[_DTYPE_NAMES[tensor.data_type]]
    shape = _shape(tensor)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        with open(base / info["location"], "rb") as handle:
            handle.seek(int(info.get("offset", 0)))
            raw = handle.read(int(info["length"])) if "length" in info else handle.read()
    elif tensor.HasField("raw_data"):
        raw = tensor.raw_data
    else:  # values in the typed fields (float_data...): numpy reads them
        return torch.from_numpy(numpy_helper.to_array(tensor).copy()).to(dtype).reshape(shape)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _check_same(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], graph: str) -> None:
    for name, tensor in want.items():
        other = got[name]
        if other.shape != tensor.shape or other.dtype != tensor.dtype or not torch.equal(_bits(other), _bits(tensor)):
            msg = (
                f"graph {graph!r}: its {name} ({list(other.shape)} {other.dtype}) is not target_model's ({list(tensor.shape)} {tensor.dtype}): "
                "the draft must read the target's embedding and head (DFlash); re-export the pair"
            )
            raise EngineBuildError(msg)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (bitwise equality: NaN payloads and signed zeros included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _one(uses: list[Use], graph: str, what: str) -> Use:
    if len(uses) != 1:
        found = [f"{u.node.op_type} {u.node.name!r}" for u in uses]
        raise EngineBuildError(f"graph {graph!r}: expected exactly one {what}, found {len(uses)} {found}; is it an export of this version?")
    return uses[0]


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _shape(tensor: onnx.TensorProto) -> tuple[int, ...]:
    return tuple(int(d) for d in tensor.dims)


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _read(graph: onnx.GraphProto, name: str) -> bool:
    return any(name in node.input for node in graph.node) or any(o.name == name for o in graph.output)
