"""Engine builds with TensorRT-RTX on the CPU, from small hand-made opset-24 graphs.

The graphs have the shape of what export writes (a TensorScatter KV write
into an in-place cache, then an ONNX Attention over the cache), a few
kilobytes each: a build takes tens of milliseconds. Skipped where
tensorrt_rtx is not installed (the graph builders stay importable for the
other engine tests); CI installs it (the ``rtx`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

from dflash_trt.engines.attention import (
    AttentionBindError,
    BoundAttention,
    attention_digest,
    attention_nodes,
    attention_tag,
    bind_attention,
)
from dflash_trt.engines.build import (
    GRAPH_INPUT,
    UNREAD_OUTPUT,
    BuildOptions,
    _GraphFailed,
    _SetBuilder,
    build_engine_set,
    parse_graph,
    unread_tensors,
)
from dflash_trt.engines.engine_set import ENGINES_JSON, read_engine_set
from dflash_trt.engines.flavour import load_flavour
from dflash_trt.engines.load import check_engine_set, load_engine_set
from dflash_trt.engines.sources import GraphSource, graph_io_from_onnx
from dflash_trt.errors import EngineBuildError, EngineError, UnsupportedExportError, UsageError
from dflash_trt.export.contract import DimRange
from dflash_trt.export.identity import file_sha256

HEADS, KV_HEADS, HEAD_DIM, MAX_CONTEXT = 2, 1, 16, 32
TOKENS = DimRange(1, 4, 8)  # the dynamic graphs' token range


def kv_attention_model(dtype=TP.FLOAT16, tokens: int | str = 4, validity: str = "mask", causal: int = 0) -> onnx.ModelProto:
    """TensorScatter K/V rows into [1, kv_heads, max_context, head_dim] caches, then Attention over them.

    ``validity`` is "mask" (bool [1, 1, tokens, max_context]), "lengths"
    (an int64 [1] graph input as Attention-24's nonpad_kv_seqlen) or
    "computed" (nonpad_kv_seqlen = write_index + tokens, inside the graph);
    ``tokens`` an int (static) or a symbol (dynamic).
    """
    value = helper.make_tensor_value_info
    q_shape, kv_shape = [1, HEADS, tokens, HEAD_DIM], [1, KV_HEADS, tokens, HEAD_DIM]
    cache_shape = [1, KV_HEADS, MAX_CONTEXT, HEAD_DIM]
    inputs = [value("q", dtype, q_shape), value("k", dtype, kv_shape), value("v", dtype, kv_shape)]
    inputs += [value("k_cache", dtype, cache_shape), value("v_cache", dtype, cache_shape)]
    inputs.append(value("write_index", TP.INT64, [1]))
    attention_inputs = ["q", "k_cache_out", "v_cache_out"]
    nodes = [
        helper.make_node("TensorScatter", ["k_cache", "k", "write_index"], ["k_cache_out"], axis=2, name="k_write"),
        helper.make_node("TensorScatter", ["v_cache", "v", "write_index"], ["v_cache_out"], axis=2, name="v_write"),
    ]
    if validity == "mask":
        inputs.append(value("mask", TP.BOOL, [1, 1, tokens, MAX_CONTEXT]))
        attention_inputs.append("mask")
    elif validity == "lengths":
        inputs.append(value("lengths", TP.INT64, [1]))
        attention_inputs += ["", "", "", "lengths"]  # slot 6: nonpad_kv_seqlen
    else:  # "computed": lengths = write_index + tokens, inside the graph
        count = helper.make_tensor("count", TP.INT64, [1], [tokens])
        nodes.append(helper.make_node("Constant", [], ["count"], value=count, name="count"))
        nodes.append(helper.make_node("Add", ["write_index", "count"], ["lengths"], name="lengths_add"))
        attention_inputs += ["", "", "", "lengths"]
    outputs = [value("out", dtype, q_shape), value("k_cache_out", dtype, cache_shape), value("v_cache_out", dtype, cache_shape)]
    nodes.append(helper.make_node("Attention", attention_inputs, ["out"], is_causal=causal, name="attn"))
    return _model(nodes, inputs, outputs)


def custom_op_model() -> onnx.ModelProto:
    """Relu, then a node of a custom domain no TensorRT knows."""
    value = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("FancyOp", ["r"], ["y"], domain="com.example", name="fancy_node"),
    ]
    return _model(nodes, [value("x", TP.FLOAT16, [2, 4])], [value("y", TP.FLOAT16, [2, 4])], custom=True)


def argmax_model() -> onnx.ModelProto:
    """ArgMax, which TensorRT lowers to a TopK whose values output nobody reads."""
    value = helper.make_tensor_value_info
    node = helper.make_node("ArgMax", ["logits"], ["token"], axis=-1, keepdims=0, name="argmax")
    return _model([node], [value("logits", TP.FLOAT, [2, 7])], [value("token", TP.INT64, [2])])


def _model(nodes, inputs, outputs, custom: bool = False) -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", 24)] + ([helper.make_opsetid("com.example", 1)] if custom else [])
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=opsets)
    model.ir_version = 10  # onnxruntime refuses IR 14
    if not custom:
        onnx.checker.check_model(model, full_check=True)
    return model


def source(tmp_path: Path, name: str, model: onnx.ModelProto, dims=None) -> GraphSource:
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    return GraphSource(name, path, graph_io_from_onnx(model, name, dims or {}))


@pytest.fixture(scope="module")
def rtx():
    """TensorRT-RTX; the tests that need it skip where it is not installed."""
    pytest.importorskip("tensorrt_rtx")
    return load_flavour("tensorrt_rtx")


def test_static_and_dynamic_graphs_build_with_the_io_of_the_contract(tmp_path, rtx):
    """Guards against a built network whose IO drifts from the graph's contract
    (renamed, retyped or re-shaped bindings, a missing or extra one, a profile
    that does not span the manifest's range) going unnoticed until runtime."""
    sources = [
        source(tmp_path, "static_fp16", kv_attention_model(TP.FLOAT16)),
        source(tmp_path, "static_bf16", kv_attention_model(TP.BFLOAT16)),
        source(tmp_path, "dynamic_bf16", kv_attention_model(TP.BFLOAT16, tokens="tokens"), {"tokens": TOKENS}),
    ]
    lines: list[str] = []
    record = build_engine_set(sources, tmp_path / "engines", rtx, progress=lines.append)
    assert set(record.engines) == {"static_fp16", "static_bf16", "dynamic_bf16"}
    for src in sources:
        bindings = {(b.mode, b.name): b for b in record.engines[src.name].bindings}
        expected = {("input", s.name) for s in src.io.inputs} | {("output", s.name) for s in src.io.outputs}
        assert set(bindings) == expected
    dyn = {b.name: b for b in record.engines["dynamic_bf16"].bindings}
    assert dyn["q"].shape == (1, HEADS, -1, HEAD_DIM) and dyn["q"].dtype == "bfloat16"
    assert dyn["q"].profiles == (((1, HEADS, 1, HEAD_DIM), (1, HEADS, 4, HEAD_DIM), (1, HEADS, 8, HEAD_DIM)),)
    assert dyn["mask"].dtype == "bool" and dyn["write_index"].dtype == "int64" and dyn["write_index"].profiles is None
    assert dyn["k_cache_out"].shape == (1, KV_HEADS, MAX_CONTEXT, HEAD_DIM) and dyn["out"].profiles is None
    static = {b.name: b for b in record.engines["static_fp16"].bindings}
    assert static["q"].shape == (1, HEADS, 4, HEAD_DIM) and static["q"].dtype == "float16" and static["q"].profiles is None
    assert len(lines) == 3 and all(" built in " in line for line in lines)
    # The loader's file/manifest stage accepts what the build wrote.
    check_engine_set(tmp_path / "engines", {s.name: s.io for s in sources})


def test_engines_json_records_hashes_flavour_targets_and_options(tmp_path, rtx):
    """Guards against an engine set that cannot be traced back: plan and
    source hashes, the TensorRT flavour/version and the targeted compute
    capabilities must be written beside the plans."""
    src = source(tmp_path, "g", kv_attention_model())
    options = BuildOptions(workspace_mb=64, targets=("sm_89", "SM120"))
    build_engine_set([src], tmp_path / "out", rtx, options)
    data = json.loads((tmp_path / "out" / ENGINES_JSON).read_text())
    assert data["flavour"] == "tensorrt_rtx" and data["trt_version"] == rtx.version
    assert data["targets"] == ["SM89", "SM120"]
    assert data["build_options"]["workspace_mb"] == 64
    engine = data["engines"]["g"]
    assert engine["plan_sha256"] == file_sha256(tmp_path / "out" / "g.plan")
    assert engine["sources"] == {"g.onnx": file_sha256(src.onnx_path)}
    assert read_engine_set(tmp_path / "out").engines["g"].plan == "g.plan"


def test_unknown_target_is_refused_with_the_supported_list(tmp_path, rtx):
    """Guards against a typo in --target silently building for the wrong GPUs."""
    with pytest.raises(EngineBuildError, match=r"SM90.*supports"):
        build_engine_set([source(tmp_path, "g", kv_attention_model())], tmp_path / "out", rtx, BuildOptions(targets=("sm_90",)))


def test_unsupported_nodes_of_every_graph_fail_in_one_typed_error(tmp_path, rtx):
    """Guards against a build that stops at the first bad node (or swallows the
    parser's reason): each failing graph's node name and message must be in one
    EngineBuildError, and the good graph between them still builds."""
    sources = [
        source(tmp_path, "custom", custom_op_model()),
        source(tmp_path, "good", kv_attention_model()),
        # TensorRT's IAttention takes a mask or a causal kind, not both.
        source(tmp_path, "causal_mask", kv_attention_model(causal=1)),
    ]
    lines: list[str] = []
    with pytest.raises(EngineBuildError) as caught:
        build_engine_set(sources, tmp_path / "out", rtx, progress=lines.append)
    failures = {(f.graph, f.node, f.operator): f.message for f in caught.value.failures}
    assert ("custom", "fancy_node", "FancyOp") in failures
    assert "Plugin not found" in failures["custom", "fancy_node", "FancyOp"]
    assert ("causal_mask", "attn", "Attention") in failures
    assert "mask cannot be used together with" in failures["causal_mask", "attn", "Attention"]
    assert "2 of 3 graphs failed" in str(caught.value) and "fancy_node" in str(caught.value)
    assert [line.split(":")[1].strip().split()[0] for line in lines] == ["FAILED", "built", "FAILED"]
    assert not (tmp_path / "out" / ENGINES_JSON).exists()


def test_a_sampled_verifier_that_fails_leaves_a_greedy_only_set(tmp_path, rtx):
    """Guards against losing the whole engine set to a graph only sampled sessions need
    (verify_sample_n does not build for a real vocabulary while TopK caps K at 3840), and
    against writing a set when a graph every session needs failed: the first build writes
    engines.json without verify_sample_1 and says why; the second refuses."""
    sources = [source(tmp_path, "verify_argmax_1", argmax_model()), source(tmp_path, "verify_sample_1", custom_op_model())]
    record = build_engine_set(sources, tmp_path / "greedy", rtx)
    assert set(record.engines) == {"verify_argmax_1"}
    assert "fancy_node" in record.skipped["verify_sample_1"]
    assert read_engine_set(tmp_path / "greedy").skipped == record.skipped
    sources.append(source(tmp_path, "verify_argmax_2", custom_op_model()))
    with pytest.raises(EngineBuildError, match="2 of 3 graphs failed"):
        build_engine_set(sources, tmp_path / "broken", rtx)
    assert not (tmp_path / "broken" / ENGINES_JSON).exists()


def test_builder_failure_carries_tensorrts_message(tmp_path, rtx):
    """Guards against a failed build_serialized_network (an fp32 attention has
    no fused kernel in TensorRT-RTX; build_engine_set refuses those before
    parsing, so the graph goes to the per-graph builder directly) surfacing as
    None or a bare 'failed'."""
    with pytest.raises(_GraphFailed) as caught:
        _SetBuilder(rtx, BuildOptions(), tmp_path).build(source(tmp_path, "fp32", kv_attention_model(TP.FLOAT)))
    assert [f.graph for f in caught.value.failures] == ["fp32"]
    assert "not supported by a dedicated kernel" in caught.value.failures[0].message


def test_fp32_attention_is_refused_before_parsing_in_one_line(tmp_path, monkeypatch):
    """Guards against TensorRT's internal Myelin error (a page of text, after minutes of parsing
    at 8B) reaching a user who builds an fp32 export: fp32 attention graphs are refused first,
    naming them and the export to make instead; fp32 graphs without attention (the verifiers)
    and bf16 attention graphs pass the check."""
    from dflash_trt.engines import build

    monkeypatch.setattr(build, "parse_graph", lambda *a: pytest.fail("parsed"))
    sources = [source(tmp_path, "fp32", kv_attention_model(TP.FLOAT)), source(tmp_path, "argmax", argmax_model())]
    with pytest.raises(UnsupportedExportError) as caught:
        build_engine_set(sources, tmp_path / "out", flavour=None)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("fp32: float32 attention")
    assert "--dtype bf16" in str(caught.value) and isinstance(caught.value, UsageError)  # the CLI: one line, exit 2
    build.refuse_unbuildable([sources[1], source(tmp_path, "bf16", kv_attention_model(TP.BFLOAT16))])


def test_live_key_attention_is_refused_before_parsing_in_one_line(tmp_path, monkeypatch):
    """Guards against building an ONNX Runtime export (``export --live-keys``: K and V sliced to a length read
    from a tensor) into plans whose attention would bind lengths to a slice no profile covers: such graphs are
    refused before parsing, named, with the export to make instead; the same graph without the slice passes."""
    import onnx_ir as ir

    from dflash_trt.engines import build
    from dflash_trt.export import graph_passes

    monkeypatch.setattr(build, "parse_graph", lambda *a: pytest.fail("parsed"))
    whole = kv_attention_model(TP.BFLOAT16, validity="lengths")
    live = ir.from_proto(whole)
    assert graph_passes.live_keys(live.graph) == 1
    sources = [source(tmp_path, "live", ir.to_proto(live)), source(tmp_path, "argmax", argmax_model())]
    with pytest.raises(UnsupportedExportError) as caught:
        build_engine_set(sources, tmp_path / "out", flavour=None)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("live: attention over the live cache slots")
    assert "--backend tensorrt" in str(caught.value) and isinstance(caught.value, UsageError)
    build.refuse_unbuildable([sources[1], source(tmp_path, "whole", whole)])


@pytest.mark.parametrize(("validity", "causal"), [("lengths", 1), ("lengths", 0), ("mask", 0)])
def test_attention_reads_the_cache_unscaled_and_the_query_carries_the_whole_scale(tmp_path, rtx, validity, causal):
    """Guards against a pass over the whole K cache before every attention: TensorRT's parser
    multiplies Q and the cache K by sqrt(scale) each (IAttention has no scale), at any scale.
    After parse_graph the attention reads the KV-cache update's output itself, Q is multiplied
    by the product of the parser's two [1, 1, 1, 1] factors, nothing is left unread, and the
    strict build succeeds (the probe checks the numbers where the plans run)."""
    trt = rtx.trt
    src = source(tmp_path, "g", kv_attention_model(TP.BFLOAT16, validity=validity, causal=causal))
    log = rtx.new_log()
    graph = parse_graph(rtx, trt.Builder(log), log, src)
    made = producers(graph.network)
    (attention,) = attention_inputs(trt, graph.network)
    assert made[attention.get_input(1).name].type == trt.LayerType.KV_CACHE_UPDATE
    query = made[attention.get_input(0).name]
    query.__class__ = trt.IElementWiseLayer
    assert query.op == trt.ElementWiseOperation.PROD and query.get_input(0).name == "q"
    factor = made[query.get_input(1).name]
    factor.__class__ = trt.IElementWiseLayer
    assert factor.op == trt.ElementWiseOperation.PROD and tuple(factor.get_output(0).shape) == (1, 1, 1, 1)
    assert unread_tensors(graph.network) == []
    assert set(build_engine_set([src], tmp_path / "out", rtx).engines) == {"g"}


def dead_tensor_model() -> onnx.ModelProto:
    """Relu, plus a graph input no node reads and an Add whose output nothing reads."""
    value = helper.make_tensor_value_info
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"), helper.make_node("Add", ["x", "x"], ["dead"], name="dead_add")]
    inputs = [value("x", TP.FLOAT16, [2, 4]), value("unused", TP.INT64, [1])]
    return _model(nodes, inputs, [value("y", TP.FLOAT16, [2, 4])])


def test_tensor_read_by_nothing_is_refused(tmp_path, rtx):
    """Guards against a plan that silently ignores part of its graph (as TensorRT's
    parser does with Attention's nonpad_kv_seqlen): a graph input or a layer output
    that nothing reads fails the build, by name; there is no option to build anyway."""
    with pytest.raises(EngineBuildError) as caught:
        build_engine_set([source(tmp_path, "g", dead_tensor_model())], tmp_path / "out", rtx)
    assert sorted((f.node, f.operator, f.tensor) for f in caught.value.failures) == [
        ("", GRAPH_INPUT, "unused"),
        ("dead_add", UNREAD_OUTPUT, "dead"),
    ]
    assert "allow_unread" not in BuildOptions.__dataclass_fields__


def producers(network) -> dict[str, object]:
    """Tensor name -> the layer that writes it."""
    layers = (network.get_layer(i) for i in range(network.num_layers))
    return {layer.get_output(j).name: layer for layer in layers for j in range(layer.num_outputs)}


def attention_inputs(trt, network) -> list:
    """The IAttention of every ATTENTION_INPUT layer, as TensorRT reports it."""
    found = []
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        if layer.type == trt.LayerType.ATTENTION_INPUT:
            layer.__class__ = trt.IAttentionInputLayer
            found.append(layer.attention)
    return found


@pytest.mark.parametrize(
    ("validity", "causal", "kind"),
    [("lengths", 1, "LOWER_RIGHT"), ("computed", 1, "LOWER_RIGHT"), ("lengths", 0, "NONE"), ("mask", 0, "NONE")],
)
def test_parsed_attention_gets_the_causality_and_lengths_of_its_node(tmp_path, rtx, validity, causal, kind):
    """Guards against engines that attend over the whole cache or top-left causally:
    TensorRT's parser drops nonpad_kv_seqlen and reads is_causal=1 as UPPER_LEFT. After
    parse_graph every attention is LOWER_RIGHT (is_causal) or NONE, its key/value
    lengths are the node's own lengths tensor cast to INT32 (a mask graph gets none),
    nothing is left unread, and the strict build records it in engines.json."""
    src = source(tmp_path, "g", kv_attention_model(TP.BFLOAT16, validity=validity, causal=causal))
    log = rtx.new_log()
    graph = parse_graph(rtx, rtx.trt.Builder(log), log, src)
    (attention,) = attention_inputs(rtx.trt, graph.network)
    assert attention.causal_kind.name == kind
    lengths = attention.key_value_lengths
    if validity == "mask":
        assert lengths is None and attention.mask is not None
    else:
        cast = producers(graph.network)[lengths.name]
        assert cast.type == rtx.trt.LayerType.CAST and cast.get_input(0).name == "lengths"
        assert lengths.dtype == rtx.trt.int32
    assert unread_tensors(graph.network) == []
    record = build_engine_set([src], tmp_path / "out", rtx)
    expected = BoundAttention("attn", kind, "" if validity == "mask" else "lengths", validity == "mask")
    assert read_engine_set(tmp_path / "out").engines["g"].attention == (expected,) == record.engines["g"].attention


def test_attention_binding_needs_an_api_that_can_set_it():
    """Guards against building a lengths export with a TensorRT whose IAttention has no
    causal_kind / key_value_lengths (TensorRT 10.x): it would compute upper-left causal
    attention over the whole cache. The build refuses, naming the node and the fix."""

    class OldAttention:  # TensorRT 10.15/10.16: a causal bool, nothing else
        causal = True

    class Layer:
        type = "ATTENTION_OUTPUT"
        name = "attn_AttentionOutput"
        num_outputs = 1
        num_inputs = 0

        def get_output(self, index):
            return SimpleNamespace(name="out")

    trt = SimpleNamespace(LayerType=SimpleNamespace(ATTENTION_OUTPUT="ATTENTION_OUTPUT"), IAttentionOutputLayer=Layer)
    network = SimpleNamespace(num_layers=1, num_inputs=0, num_outputs=0, get_layer=lambda i: Layer())
    Layer.attention = OldAttention()
    nodes = attention_nodes(kv_attention_model(validity="lengths", causal=1))
    with pytest.raises(AttentionBindError, match=r"TensorRT 10\.16\.0.*need TensorRT >= 11\.0.*--causal mask") as caught:
        bind_attention(trt, network, nodes, "10.16.0")
    assert caught.value.node == "attn"
    masked = attention_nodes(kv_attention_model(validity="mask", causal=0))
    assert bind_attention(trt, network, masked, "10.16.0") == [BoundAttention("attn", "UPPER_LEFT", "", True)]


def test_live_layer_with_one_unread_output_is_not_refused(tmp_path, rtx):
    """Guards against the dead-tensor check refusing every verifier graph:
    a TopK (from ArgMax) is live when its indices are used, even though its
    values output is read by nothing."""
    record = build_engine_set([source(tmp_path, "argmax", argmax_model())], tmp_path / "out", rtx)
    assert set(record.engines) == {"argmax"}


def test_graph_that_disagrees_with_the_contract_is_refused_before_building(tmp_path, rtx):
    """Guards against building (and shipping) an engine from a graph whose IO
    is not what the contract says, e.g. an fp16 export against a bf16 contract."""
    good = source(tmp_path, "g", kv_attention_model(TP.BFLOAT16))
    onnx.save(kv_attention_model(TP.FLOAT16), good.onnx_path)  # the file changes, the contract does not
    with pytest.raises(EngineBuildError, match=r"input 'q' dtype: contract bfloat16, engine float16"):
        build_engine_set([good], tmp_path / "out", rtx)


def test_plans_do_not_deserialize_without_a_gpu_and_the_loader_says_so(tmp_path, rtx):
    """Guards against a crash (or a None engine) when plans are loaded where the
    runtime cannot run them; here: no CUDA GPU at all."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: covered by selfcheck")
    src = source(tmp_path, "g", kv_attention_model())
    build_engine_set([src], tmp_path / "out", rtx)
    with pytest.raises(EngineError, match=r"engine 'g'.*cannot"):
        load_engine_set(tmp_path / "out", {"g": src.io}, rtx)


def test_verify_sample_for_a_150k_vocabulary_builds(tmp_path, rtx):
    """Guards against a sampler TensorRT cannot compile for a real vocabulary (the old one sorted
    all V logits with TopK, which TensorRT caps at K = 3840, and used a cumulative sum): the
    exported verify_sample_1 of a bf16 export with Qwen's 151,936-token vocabulary (fp32 logits,
    as the contract has them) builds strictly, every binding the contract's, nothing unread."""
    from dflash_trt.export import contract
    from dflash_trt.export.exporter import export_graph
    from dflash_trt.export.graph_modules import VerifySample

    dims = contract.Dims(
        vocab_size=151936, tap_width=8, block_size=16, proposals=15, max_owners=1, max_context=64, max_chunk=8,
        target_layers=1, target_kv_heads=1, target_head_dim=8, draft_layers=1, draft_kv_heads=1, draft_head_dim=8,
        dtype="bfloat16",
    )
    spec = contract.graph_spec(dims, "verify_sample_1")
    graph = export_graph(VerifySample(), spec, tmp_path)
    src = GraphSource(spec.name, tmp_path / graph.file, spec)
    log = rtx.new_log()
    assert unread_tensors(parse_graph(rtx, rtx.trt.Builder(log), log, src).network) == []
    record = build_engine_set([src], tmp_path / "engines", rtx)
    engine = record.engines[spec.name]
    assert {(b.mode, b.name) for b in engine.bindings} == {("input", s.name) for s in spec.inputs} | {("output", s.name) for s in spec.outputs}
    assert {b.name: b.shape for b in engine.bindings}["logits"] == (1, 16, 151936)


def weight_model(rows: int = 4096, cols: int = 8192) -> onnx.ModelProto:
    """y [M, cols] = x [M, rows] @ W: one fp16 weight of rows * cols (64 MiB by default)."""
    weight = onnx.numpy_helper.from_array(torch.randn(rows, cols).half().numpy(), "w")
    x = helper.make_tensor_value_info("x", TP.FLOAT16, ["M", rows])
    y = helper.make_tensor_value_info("y", TP.FLOAT16, ["M", cols])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], initializer=[weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    return model


def test_model_profiles_never_pin_a_row_count_at_one():
    """Guards against a model engine holding its weights twice: TensorRT-RTX stores a second,
    one-row layout of every weight that a profile with exactly one row meets (the Qwen3-8B-wide
    target plan with prefill and decode_1 among its profiles held its layers twice). Every
    row dim (tokens per owner, picked rows) of every model profile spans at least [1, 2]."""
    from dflash_trt.export import contract

    dims = contract.Dims(
        vocab_size=100, tap_width=32, block_size=4, proposals=3, max_owners=3, max_context=64, max_chunk=16,
        target_layers=1, target_kv_heads=2, target_head_dim=16, draft_layers=1, draft_kv_heads=1, draft_head_dim=16,
        dtype="bfloat16",
    )
    for name in contract.MODEL_KINDS:
        for profile in contract.profiles_of(contract.graph_spec(dims, name)):
            for dim in set(contract.ROW_DIMS) & set(profile.dims):
                assert profile.dims[dim].max >= 2, (name, profile.graph, dim)
            assert all(profile.dims[d].min <= v <= profile.dims[d].max for d, v in profile.sizes({"T": 1, "C": 1}).items())


def test_two_profiles_one_of_them_one_row_store_the_weight_once(tmp_path, rtx):
    """Guards against the one-row profile rule not doing what it is for: a MatMul engine with the
    profiles a decode_1 and a verify run graph get (rows in [1, 2] and rows = 8) holds its 64 MiB
    weight once (plan <= 1.15 x the weight's bytes), as the one-profile build does."""
    from dflash_trt.export.contract import ONE_ROW, GraphSpec, Profile

    model = weight_model()
    path = tmp_path / "matmul.onnx"
    onnx.save(model, path)
    io = graph_io_from_onnx(model, "matmul", {"M": DimRange(1, 8, 8)})
    profiles = (Profile("one_row", {"M": 1}, {"M": ONE_ROW}), Profile("eight_rows", {"M": 8}, {"M": DimRange(8, 8, 8)}))
    spec = GraphSpec(io.name, io.kind, None, io.inputs, io.outputs, io.dims, profiles)
    record = build_engine_set([GraphSource("matmul", path, spec)], tmp_path / "engines", rtx)
    weight_bytes = 4096 * 8192 * 2
    assert record.engines["matmul"].profiles == ("one_row", "eight_rows")
    assert record.engines["matmul"].plan_bytes <= 1.15 * weight_bytes


def test_a_plan_carries_the_digest_of_its_attention_as_it_was_built(tmp_path, rtx):
    """Guards against engines.json's attention records being the only word on how a plan
    attends (a hand edit would go unnoticed where the plans run): the build records the
    records' digest and gives the network a name holding it, which TensorRT stores in the plan
    (the deserialized engine reports it as its name; the loader compares)."""
    record = build_engine_set([source(tmp_path, "g", kv_attention_model(TP.FLOAT16, validity="lengths", causal=1))], tmp_path / "out", rtx)
    engine = record.engines["g"]
    assert [(a.causal, a.lengths) for a in engine.attention] == [("LOWER_RIGHT", "lengths")]
    assert engine.attention_sha256 == attention_digest(engine.attention)
    assert attention_tag(engine.attention).encode() in (tmp_path / "out" / "g.plan").read_bytes()
    assert read_engine_set(tmp_path / "out").engines["g"].attention_sha256 == engine.attention_sha256
