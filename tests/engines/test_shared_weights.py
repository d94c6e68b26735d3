"""The weights lifted out of the model graphs for TensorRT compute what the graphs compute.

``engines.shared_weights`` rewrites ``target_model`` and ``draft_model`` so that
the target's embedding and LM head are graph inputs, read by both engines from
one file. Checked here with ONNX Runtime on the CPU, bit for bit: every profile
of both models of two real exports — the tiny pair (untied head, weights in one
external ``weights.data``) and the shipped default pair (tied: its head is the
embedding, read through a Transpose the rewrite folds) — run as exported and
as rewritten with the shared tensors fed. MLAS prepacks a MatMul's constant B
into another summation order than a fed B, so prepacking is off in both
sessions. No TensorRT needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from safetensors.torch import load_file

from dflash_trt.engines.selfcheck import random_feeds
from dflash_trt.engines.shared_weights import lift_shared_weights
from dflash_trt.engines.sources import GraphSource, export_sources
from dflash_trt.errors import EngineBuildError
from dflash_trt.export import contract as c
from dflash_trt.export.pair import DEFAULT_PAIR_DIR


def _session(model: str | bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _rewritten_file(source: GraphSource, data: bytes, folder: Path) -> str:
    """The rewritten graph as a file whose external weights resolve (copies of the export's: ONNX
    Runtime refuses links that leave the model's folder)."""
    model = onnx.ModelProto.FromString(data)
    for name in {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}:
        link = folder / name
        if not link.exists():
            shutil.copyfile(source.onnx_path.parent / name, link)
    path = folder / f"{source.name}.onnx"
    path.write_bytes(data)
    return str(path)


@pytest.fixture(params=["tiny", "default"])
def export(request, exported_pair, default_pair_cache) -> tuple[Path, Path]:
    """(export directory, the target's checkpoint): the tiny pair's fp32 export with one external
    weights file, or the default pair's (tied embedding) from the demo's cache."""
    if request.param == "tiny":
        return exported_pair.out, exported_pair.target_dir
    return next((default_pair_cache / "export").iterdir()), DEFAULT_PAIR_DIR / "target"


def test_lifted_model_graphs_compute_what_the_exported_graphs_compute(export, tmp_path):
    """Bug: an engine built from the rewritten graph reads the wrong tensor as its embedding or head
    (a transposed head, the tied weight's Transpose left to run per step or folded the wrong way,
    another [V, H] constant taken for the embedding), or still carries its own copy. The shared
    tensors are the checkpoint's embedding and head (transposed); no initializer of either's size
    is left in the rewritten graphs; every profile's outputs equal the exported graph's."""
    directory, checkpoint = export
    sources, _manifest = export_sources(directory)
    lifted = lift_shared_weights(sources)
    weights = load_file(checkpoint / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"].float()
    assert torch.equal(lifted.tensors[c.SHARED_EMBEDDING], embedding)
    assert torch.equal(lifted.tensors[c.SHARED_HEAD], weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float().t())
    shared = {name: tensor.numpy() for name, tensor in lifted.tensors.items()}
    models = [s for s in sources if s.io.kind in c.MODEL_KINDS]
    assert sorted(lifted.graphs) == sorted(s.name for s in models) == sorted(c.MODEL_KINDS)
    for source in models:
        rewritten = onnx.ModelProto.FromString(lifted.graphs[source.name])
        assert all(int(np.prod(t.dims)) != embedding.numel() for t in rewritten.graph.initializer), source.name
        exported, lifted_session = _session(str(source.onnx_path)), _session(_rewritten_file(source, lifted.graphs[source.name], tmp_path))
        for index, profile in enumerate(c.profiles_of(source.io)):
            feeds = {name: tensor.numpy() for name, tensor in random_feeds(source.io, index, (1, 3), profile.dims, 8).items()}
            want, got = exported.run(None, feeds), lifted_session.run(None, feeds | shared)
            assert all(np.array_equal(a, b) for a, b in zip(want, got)), (source.name, profile.graph)


def _model(path: Path, head: np.ndarray, embedding: np.ndarray) -> None:
    """ids -> Gather(embedding) -> @ Transpose(head): a model graph's two uses, hand-made."""
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["rows"], axis=0),
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["rows", "Wt"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [3, 5])],
        [onnx.numpy_helper.from_array(embedding, "E"), onnx.numpy_helper.from_array(head, "W")],
    )
    onnx.save(helper.make_model(graph), path)


def test_a_draft_reading_another_head_than_the_targets_is_refused(tmp_path):
    """Bug: a draft with a head of its own built against the target's (its proposals would come
    from the wrong weights, silently): the build names the graph and the tensor."""
    dims = c.Dims(
        vocab_size=5, tap_width=4, block_size=4, proposals=3, max_owners=1, max_context=16, max_chunk=8,
        target_layers=1, target_kv_heads=1, target_head_dim=2, draft_layers=1, draft_kv_heads=1, draft_head_dim=2, dtype="float32",
    )
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((5, 4)).astype(np.float32)
    _model(tmp_path / "target.onnx", embedding, embedding)
    _model(tmp_path / "draft.onnx", embedding + 1, embedding)
    sources = [GraphSource(name, tmp_path / f"{file}.onnx", c.graph_spec(dims, name)) for name, file in (("target_model", "target"), ("draft_model", "draft"))]
    with pytest.raises(EngineBuildError, match=r"graph 'draft_model': its shared_head .* is not target_model's .*re-export"):
        lift_shared_weights(sources)
    _model(tmp_path / "draft.onnx", embedding, embedding)
    lifted = lift_shared_weights(sources)
    assert torch.equal(lifted.tensors[c.SHARED_HEAD], torch.from_numpy(embedding.T.copy()))
    session = _session(lifted.graphs["draft_model"])
    ids = np.array([4, 0, 2])
    got = session.run(None, {"ids": ids} | {n: t.numpy() for n, t in lifted.tensors.items()})[0]
    np.testing.assert_array_equal(got, _session(str(tmp_path / "draft.onnx")).run(None, {"ids": ids})[0])
    assert [n.op_type for n in onnx.ModelProto.FromString(lifted.graphs["draft_model"]).graph.node] == ["Gather", "MatMul"]
