"""What to build: one ``GraphSource`` per exported ONNX graph.

A source pairs the graph file with the IO its engine must have (the
contract's ``GraphSpec``). ``graph_io_from_onnx`` reads the IO an ONNX file
declares, used to refuse a graph that disagrees with the contract before
TensorRT spends time on it, and by tests that build hand-made graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from dflash_trt.errors import EngineError
from dflash_trt.export import onnx_io
from dflash_trt.export.contract import DimRange, GraphSpec


@dataclass(frozen=True)
class GraphSource:
    """One graph to build: its name (= the engine's), its file, its IO."""

    name: str
    onnx_path: Path
    io: GraphSpec
    file_hashes: Mapping[str, str] = field(default_factory=dict)  # file name -> sha256, when already known


def load_graph(path: Path) -> onnx.ModelProto:
    """The graph without its external weights (cheap even for an 8B model)."""
    try:
        return onnx_io.load_graph(path)
    except (OSError, DecodeError) as error:
        msg = f"cannot read ONNX graph {path}: {error}"
        raise EngineError(msg) from error


def graph_io_from_onnx(model: onnx.ModelProto, name: str, dims: Mapping[str, DimRange]) -> GraphSpec:
    """The IO the graph declares (initializers listed as inputs are not IO), as a spec of kind "onnx"."""
    inputs, outputs = onnx_io.declared_io(model)
    used = {d for s in inputs + outputs for d in s.shape if isinstance(d, str)}
    return GraphSpec(name, "onnx", None, inputs, outputs, {k: v for k, v in dims.items() if k in used})


def source_files(path: Path, model: onnx.ModelProto) -> list[Path]:
    """The graph file and every external-data file its tensors point to."""
    return [Path(path)] + [Path(path).parent / name for name in onnx_io.external_data_files(model)]


def export_sources(onnx_dir: Path) -> tuple[list[GraphSource], Path]:
    """Every graph of an export directory with its contract IO, and the manifest path.

    ``load_manifest`` checks the manifest against the contract and every file
    (IO and sha256), so its hashes are reused instead of hashing the weights
    again.
    """
    from dflash_trt.export.contract import export_specs
    from dflash_trt.export.manifest import MANIFEST_FILE, VERIFY_HASH, load_manifest

    manifest = load_manifest(onnx_dir, verify=VERIFY_HASH)
    specs = export_specs(manifest.dims())
    sources = []
    for name, graph in manifest.graphs.items():
        hashes = {graph.file: graph.sha256, **graph.data_files}
        sources.append(GraphSource(name, Path(onnx_dir) / graph.file, specs[name], hashes))
    return sources, Path(onnx_dir) / MANIFEST_FILE
