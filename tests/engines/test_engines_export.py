"""Every graph of real exports compiles with TensorRT-RTX (CPU), strictly, and computes the graph's attention.

Three exports, each built once per test session (module fixtures; exports
are the slow part, ~1 min each on 2 cores, so each graph is exported once):

- the tiny pair (conftest's ``tiny_pair``) in fp16 with lengths (max_owners
  2: both models with every profile and the small graphs, 7 graphs), built
  through the CLI;
- the default pair (``export/default_pair``: V 8192, 8 layers) in bf16 with
  lengths (max_owners 1: 5 graphs, through the CLI), and with masks: only the
  two model graphs the mask changes (the verifiers are the same graphs).

No build may leave a tensor unread (there is no option to allow it), and the
parsed networks are inspected: every target attention is lower-right causal
with the graph's own ``start + T`` as its key/value lengths, every draft
attention non-causal with ``start + B``, and mask graphs keep their masks
and get no lengths. Any graph that fails to build fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash_trt.engines.attention import attention_digest, attention_nodes
from dflash_trt.engines.build import parse_graph, unread_tensors
from dflash_trt.engines.engine_set import read_engine_set
from dflash_trt.engines.flavour import load_flavour
from dflash_trt.engines.load import check_engine_set, engine_contract
from dflash_trt.engines.sources import GraphSource, export_sources, load_graph
from dflash_trt.export import contract
from dflash_trt.export.pair import DEFAULT_PAIR_DIR

import prebuilt

@dataclass
class BuiltSet:
    """One export and its engine set (or the build's error)."""

    label: str
    dtype: str
    causal: str
    sources: list[GraphSource]
    out: Path
    checkpoint: Path  # the target's Hugging Face checkpoint
    error: str = ""  # the build's stderr when some graphs failed
    printed: str = ""  # the build's stdout


@pytest.fixture(scope="module", params=prebuilt.ENGINE_LABELS)
def built(request, build_cache) -> BuiltSet:
    """An export and its engine set (both cached between runs, build_cache.py; built in the background
    during a full run, prebuilt.py)."""
    pytest.importorskip("tensorrt_rtx")
    label = request.param
    _, dtype, causal = label.split("-")
    out = prebuilt.engines(build_cache, label)
    if causal == "mask":
        sources = prebuilt.mask_sources(build_cache)
    else:
        sources, _manifest = export_sources(prebuilt.export_of(build_cache, label))
    checkpoint = prebuilt.tiny_pair(build_cache)[0] if label.startswith("tiny") else DEFAULT_PAIR_DIR / "target"
    return BuiltSet(label, dtype, causal, sources, out, checkpoint, (out.parent / prebuilt.ERROR).read_text(), (out.parent / prebuilt.PRINTED).read_text())


def test_every_exported_graph_builds_strictly_with_the_io_of_the_contract(built):
    """Guards against an exported graph that TensorRT cannot compile, that compiles only by
    leaving a tensor unread (TensorRT dropped part of it), or that compiles to an engine whose
    bindings (names, shapes, dtypes, profile ranges of the dynamic T/C dims) are not the
    contract's: the runtime would only find out on a GPU. Every graph of the export builds (none is
    skipped: the sampled verifiers too, since the sampler needs no vocabulary-wide sort)."""
    if built.error:
        pytest.fail(built.error)
    skipped = read_engine_set(built.out).skipped
    assert not skipped, skipped
    check_built_set(built, {s.name: s.io for s in built.sources})


def check_built_set(built: BuiltSet, specs) -> None:
    """The set has exactly ``specs``' engines, each with the contract's IO and its attention bound."""
    from dflash_trt.export.contract import DTYPES

    record = check_engine_set(built.out, specs)  # recorded bindings == contract, plans hash-checked
    assert set(record.engines) == set(specs)
    check_shared_weights(built, record)
    engine_specs = engine_contract(built.out, record, specs)  # the models read the shared weights
    for name, engine in record.engines.items():
        spec = engine_specs[name]
        expected = {("input", s.name) for s in spec.inputs} | {("output", s.name) for s in spec.outputs}
        assert {(b.mode, b.name) for b in engine.bindings} == expected
        assert {b.dtype for b in engine.bindings} <= {DTYPES[built.dtype], "float32", "int64"}
        kind = spec.kind
        causal = "LOWER_RIGHT" if kind.startswith("target") and built.causal == "lengths" else "NONE"
        masked = built.causal == "mask"
        assert {(a.causal, bool(a.lengths), a.mask) for a in engine.attention} <= {(causal, not masked, masked)}, name
        assert engine.attention_sha256 == attention_digest(engine.attention), name
    dynamic = {name for name, engine in record.engines.items() if any(b.profiles for b in engine.bindings)}
    assert dynamic == {contract.TARGET_MODEL, contract.DRAFT_MODEL, contract.SAMPLE} & set(specs)
    for name in set(specs) & set(contract.MODEL_KINDS):  # one engine per model: a profile per run graph
        engine, served = record.engines[name], [p.graph for p in contract.profiles_of(specs[name])]
        assert list(engine.profiles) == served and len(served) > 1, name
        assert all(len(b.profiles) == len(served) for b in engine.bindings if b.profiles), name
    check_probe(built, record)
    if built.printed:  # built through the CLI from an export directory
        lines = built.printed.splitlines()
        assert sum(" built in " in line for line in lines) == len(specs) + 1  # the graphs and the probe
        assert any(line.startswith("[probe] built in") for line in lines)
        assert read_engine_set(built.out).source_manifest["file"] == "manifest.json"


def check_shared_weights(built: BuiltSet, record) -> None:
    """The target's embedding and LM head are in the set once, as the shared file, bit for bit the
    checkpoint's values in the export dtype (the head transposed; a tied pair's head is its
    embedding); the plans read them as inputs."""
    from safetensors.torch import load_file

    from dflash_trt.engines.shared_weights import read_shared_weights
    from dflash_trt.export.torch_dtypes import TORCH_DTYPES

    shared = read_shared_weights(built.out, record.shared_weights)
    weights = load_file(built.checkpoint / "model.safetensors")
    dtype = TORCH_DTYPES[contract.DTYPES[built.dtype]]
    embedding = weights["model.embed_tokens.weight"].to(dtype)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).to(dtype)
    assert torch.equal(shared[contract.SHARED_EMBEDDING].view(torch.int16), embedding.view(torch.int16)), built.label
    assert torch.equal(shared[contract.SHARED_HEAD].view(torch.int16), head.t().contiguous().view(torch.int16)), built.label
    for name in set(record.engines) & set(contract.MODEL_KINDS):
        inputs = {b.name for b in record.engines[name].bindings if b.mode == "input"}
        assert set(contract.SHARED_WEIGHTS) <= inputs, name


def check_probe(built: BuiltSet, record) -> None:
    """The set carries its semantics probe, built with the set's own attention constructions
    (target lower-right with lengths and draft non-causal with lengths, or masks), unproven
    (no GPU here: the first load on one runs it)."""
    from dflash_trt.engines.probe import ProbeSpec

    probe = record.probe
    assert probe is not None and probe.verdicts == ()
    spec = ProbeSpec.from_json(probe.spec)
    assert (spec.causal, spec.dtype) == (built.causal, contract.DTYPES[built.dtype])
    masked = built.causal == "mask"
    kinds = [(a.causal, bool(a.lengths), a.mask) for a in probe.engine.attention]
    assert kinds == ([("NONE", False, True)] * 2 if masked else [("LOWER_RIGHT", True, False), ("NONE", True, False)])
    assert (built.out / probe.engine.plan).is_file() and probe.engine.warnings is not None


def ancestors(network, tensor) -> set[str]:
    """Names of the network inputs ``tensor`` is computed from."""
    producers = {}
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        for j in range(layer.num_outputs):
            producers[layer.get_output(j).name] = layer
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    seen, stack, found = set(), [tensor.name], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs:
            found.add(name)
        layer = producers.get(name)
        if layer is not None:
            stack.extend(layer.get_input(j).name for j in range(layer.num_inputs) if layer.get_input(j) is not None)
    return found


LENGTH_INPUTS = {"target": {contract.START}, "draft": {contract.CTX_START, contract.CTX_COUNT}}


def test_every_parsed_attention_is_lower_right_causal_or_non_causal_with_its_lengths(built):
    """Guards against engines that compute other attention than their graphs: TensorRT's
    parser drops nonpad_kv_seqlen and reads is_causal=1 top-left. Inspected with TensorRT-RTX
    on every parsed graph with attention: each IAttention is LOWER_RIGHT (target, lengths
    export) or NONE (draft; any mask export); its key/value lengths are an INT32 cast of
    the very tensor the ONNX node fed to nonpad_kv_seqlen, computed from the graph's own
    start input (a mask export: the mask, no lengths); nothing is left unread."""
    flavour = load_flavour("tensorrt_rtx")
    trt = flavour.trt
    builder = trt.Builder(flavour.new_log())
    for source in built.sources:
        nodes = {n.output: n for n in attention_nodes(load_graph(source.onnx_path))}
        if not nodes:
            continue
        log = flavour.new_log()
        graph = parse_graph(flavour, builder, log, source)
        network = graph.network
        kind = source.io.kind.split("_")[0]
        layers = [network.get_layer(i) for i in range(network.num_layers)]  # after binding: the casts too
        outputs = [layer for layer in layers if layer.type == trt.LayerType.ATTENTION_OUTPUT]
        assert len(outputs) == len(nodes), source.name
        for layer in outputs:
            layer.__class__ = trt.IAttentionOutputLayer
            attention, node = layer.attention, nodes[layer.get_output(0).name]
            lengths = attention.key_value_lengths
            if built.causal == "mask":
                assert attention.causal_kind.name == "NONE" and attention.mask is not None and lengths is None, source.name
                continue
            want = "LOWER_RIGHT" if kind == "target" else "NONE"
            assert (attention.causal_kind.name, attention.mask) == (want, None), source.name
            assert lengths is not None and lengths.dtype == trt.int32, source.name
            cast = next(l for l in layers if l.num_outputs and l.get_output(0).name == lengths.name)
            assert cast.type == trt.LayerType.CAST and cast.get_input(0).name == node.lengths, source.name
            assert LENGTH_INPUTS[kind] <= ancestors(network, lengths), source.name
        for layer in (l for l in layers if l.type == trt.LayerType.ATTENTION_INPUT):  # the cache read unscaled
            layer.__class__ = trt.IAttentionInputLayer
            keys = next(l for l in layers if l.num_outputs and l.get_output(0).name == layer.attention.get_input(1).name)
            assert keys.type == trt.LayerType.KV_CACHE_UPDATE, source.name
        assert unread_tensors(network) == [], source.name
