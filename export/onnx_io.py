"""What an ONNX file declares, read without its weights.

The exporter (checking what it traced), the manifest loader (checking files
against the manifest) and the engine builder (refusing a graph that disagrees
with the contract before TensorRT spends time on it) all read graphs here:
the IO as contract ``TensorSpec``s, and the external-data files the graph's
tensors point to.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from dflash_trt.export.contract import ONNX_ELEMENT_TYPES, TensorSpec

_CONTRACT_DTYPES = {element: name for name, element in ONNX_ELEMENT_TYPES.items()}


def load_graph(path: str | Path) -> onnx.ModelProto:
    """The graph without its external weights (cheap even for an 8B model).

    Raises ``OSError`` / ``google.protobuf.message.DecodeError``: each caller
    turns them into its own typed error.
    """
    return onnx.load(str(path), load_external_data=False)


def tensor_spec(value: onnx.ValueInfoProto) -> TensorSpec:
    """One declared input or output: dim names stay names, the element type becomes a contract dtype name."""
    tensor = value.type.tensor_type
    dims = tuple(d.dim_param if d.HasField("dim_param") else int(d.dim_value) for d in tensor.shape.dim)
    dtype = _CONTRACT_DTYPES.get(tensor.elem_type) or onnx.TensorProto.DataType.Name(tensor.elem_type).lower()
    return TensorSpec(value.name, dims, dtype)


def declared_io(model: onnx.ModelProto) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) in declaration order; initializers listed as inputs are weights, not IO."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = tuple(tensor_spec(v) for v in model.graph.input if v.name not in initializers)
    return inputs, tuple(tensor_spec(v) for v in model.graph.output)


def external_data_files(model: onnx.ModelProto) -> list[str]:
    """Names (relative to the graph file) of the external-data files its tensors point to, sorted."""
    locations = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(e.value for e in tensor.external_data if e.key == "location")
    return sorted(locations)
