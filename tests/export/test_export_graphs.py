"""Exported ONNX graphs against the contract and against the PyTorch wrappers they were traced from.

ONNX Runtime (CPU) runs every run graph of the tiny fp32 export on fresh
random inputs — the target / draft ones through their model network
(``target_model`` / ``draft_model``) fed by the contract's rules, the small
graphs as they are; the run graph's own wrapper with ``EagerKernels`` runs
in PyTorch; outputs must agree (fp32: max relative error <= 1e-4) and the
cache outputs must differ from the cache inputs exactly in the slots the
graph is meant to write.
"""

from __future__ import annotations

import collections
import time
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dflash_trt.export import contract, graph_passes
from dflash_trt.export.contract import DTYPES
from dflash_trt.export.exporter import ExportOptions, contract_dims, export_graph, kernels_of
from dflash_trt.export.graph_modules import graph_module
from dflash_trt.export.layers import EagerKernels
from dflash_trt.export.onnx_kernels import CAUSAL_MASK, OnnxKernels
from dflash_trt.export.pair import load_pair
from dflash_trt.export.sampling import choose, seed_parts
from dflash_trt.export.torch_dtypes import TORCH_DTYPES

FP32_TOLERANCE = 1e-4
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64}
SHORT = contract.default_verify_proposals(7)[:-1]  # the tiny draft's block 8 (P = 7) offers verify lengths 3 and 7
GRAPHS = contract.graph_names(3, SHORT)  # run graphs
EXPORTED = contract.export_names(3, SHORT)  # exported graphs


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # TensorScatter warns on every copy of an unaliased cache
    options.intra_op_num_threads = 1  # idle ORT threads spin and starve PyTorch on 2-core CI
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def declared_io(path) -> dict[str, dict[str, tuple]]:
    """{inputs|outputs: {name: (shape, elem type name)}} read with onnx alone."""
    model = onnx.load(str(path))
    weights = {t.name for t in model.graph.initializer}

    def one(value):
        shape = tuple(d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim)
        return shape, onnx.TensorProto.DataType.Name(value.type.tensor_type.elem_type)

    return {
        "inputs": {v.name: one(v) for v in model.graph.input if v.name not in weights},
        "outputs": {v.name: one(v) for v in model.graph.output},
    }


ONNX_TYPE = {"float32": "FLOAT", "float16": "FLOAT16", "bfloat16": "BFLOAT16", "int64": "INT64"}


def assert_bindings_equal_contract(path, spec: contract.GraphSpec) -> None:
    io = declared_io(path)
    for side, specs in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        assert set(io[side]) == {s.name for s in specs}, f"{spec.name} {side}"
        for s in specs:
            assert io[side][s.name] == (tuple(s.shape), ONNX_TYPE[s.dtype]), f"{spec.name} {s.name}"


# --- random inputs: valid values, and the cache slots each graph writes -------------------------


def _caches(spec, rng, dtype) -> dict[str, np.ndarray]:
    return {s.name: rng.standard_normal(s.shape).astype(dtype) for s in spec.cache_inputs}


def random_inputs(spec: contract.GraphSpec, dims: contract.Dims, rng: np.random.Generator):
    """(inputs by name, written [lo, hi) slot range per owner or None)."""
    n, V, L, B = spec.owners or 1, dims.vocab_size, dims.max_context, dims.block_size
    P = contract.verify_length(spec.name) or dims.proposals  # a verify graph's length
    dtype = NUMPY_DTYPES[dims.dtype]
    feeds = _caches(spec, rng, dtype)
    if spec.kind in (contract.TARGET_PREFILL, contract.TARGET_VERIFY, contract.TARGET_DECODE):
        tokens = {contract.TARGET_PREFILL: 5, contract.TARGET_DECODE: 1}.get(spec.kind, P + 1)
        start = rng.integers(0, L - tokens + 1, n)
        feeds |= {contract.TOKENS: rng.integers(0, V, (n, tokens)), contract.START: start}
        return feeds, [(s, s + tokens) for s in start]
    if spec.kind == contract.DRAFT_CONTEXT:
        rows = 6
        start = rng.integers(0, L - rows + 1, 1)
        feeds |= {contract.TAPS: rng.standard_normal((1, rows, dims.tap_width)).astype(dtype), contract.START: start}
        return feeds, [(start[0], start[0] + rows)]
    if spec.kind == contract.DRAFT:
        count = rng.integers(0, B + 1, n)
        ctx_start = np.array([rng.integers(0, L - B - c + 1) for c in count])
        taps = rng.standard_normal((n, B, dims.tap_width)).astype(dtype)
        taps[np.arange(B)[None, :] >= count[:, None]] = 0  # padding rows, as the runtime sends them
        feeds |= {
            contract.CTX_TAPS: taps,
            contract.CTX_START: ctx_start,
            contract.CTX_COUNT: count,
            contract.ANCHOR: rng.integers(0, V, n),
        }
        return feeds, [(s, s + c + B) for s, c in zip(ctx_start, count)]
    if spec.kind == contract.SAMPLE:
        rows = 7
        feeds |= {contract.LOGITS: (3 * rng.standard_normal((rows, V))).astype(np.float32)} | sampling_inputs(rng, rows)
        return feeds, None
    return verifier_inputs(spec, dims, rng), None


def sampling_inputs(rng, rows: int) -> dict[str, np.ndarray]:
    """Per-row sampling parameters (greedy, top-k, top-p, untruncated), seeds and positions."""
    return {
        contract.TEMPERATURE: np.array([(0.0, 0.8, 1.5, 1.0)[i % 4] for i in range(rows)], np.float32),
        contract.TOP_K: np.array([(0, 5, 40, 0)[i % 4] for i in range(rows)], np.int64),
        contract.TOP_P: np.array([(1.0, 0.9, 0.6, 1.0)[i % 4] for i in range(rows)], np.float32),
        contract.SEED: np.array([seed_parts(int(s)) for s in rng.integers(0, 2**63, rows)], np.int64),
        contract.POSITION: rng.integers(0, 60, rows),
    }


def verifier_inputs(spec, dims, rng) -> dict[str, np.ndarray]:
    """Logits + candidates whose proposals match the target's choices for a random prefix per owner."""
    n, V, P = spec.owners, dims.vocab_size, contract.verify_length(spec.name) or dims.proposals
    logits = (3 * rng.standard_normal((n, P + 1, V))).astype(np.float32)
    feeds = {contract.LOGITS: logits}
    if spec.kind == contract.VERIFY_ARGMAX:
        choices = logits.argmax(-1)
    else:
        params = sampling_inputs(rng, n)
        feeds |= params
        names = (contract.TEMPERATURE, contract.TOP_K, contract.TOP_P, contract.SEED)
        per_row = [torch.from_numpy(np.repeat(params[k], P + 1, axis=0)) for k in names]
        positions = torch.from_numpy((params[contract.POSITION][:, None] + np.arange(P + 1)).reshape(-1))
        choices = choose(torch.from_numpy(logits.reshape(-1, V)), *per_row, positions).reshape(n, P + 1).numpy()
    candidates = rng.integers(0, V, (n, P + 1))
    for i, accept in enumerate(rng.integers(0, P + 1, n)):
        candidates[i, 1 : accept + 1] = choices[i, :accept]
        if accept < P:
            candidates[i, accept + 1] = (choices[i, accept] + 1) % V
    feeds[contract.CANDIDATES] = candidates
    return feeds


# --- running both sides ----------------------------------------------------------------------------


def run_eager(module, spec, feeds) -> dict[str, np.ndarray]:
    args = [torch.from_numpy(np.array(feeds[s.name])) for s in spec.inputs]
    with torch.no_grad():
        outputs = module(*args)
    return {s.name: o.detach().numpy() for s, o in zip(spec.outputs, outputs)}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def compare(spec, feeds, written, ours, theirs, tolerance) -> dict[str, float]:
    """Assert ORT (``ours``) == eager (``theirs``); caches changed only in ``written``. Returns errors."""
    errors = {}
    for s in spec.outputs:
        got, want = ours[s.name], theirs[s.name]
        assert got.shape == want.shape and got.dtype == want.dtype, s.name
        if s.dtype == "int64":
            assert np.array_equal(got, want), f"{spec.name} {s.name}: {got} != {want}"
            continue
        errors[s.name] = relative_error(got, want)
        assert errors[s.name] <= tolerance, f"{spec.name} {s.name}: relative error {errors[s.name]:.2e}"
        if s.name.startswith("present_"):
            past = feeds["past_" + s.name.removeprefix("present_")]
            untouched = np.ones(past.shape, bool)
            for row, (lo, hi) in enumerate(written):
                untouched[row, :, lo:hi] = False
            assert np.array_equal(got[untouched], past[untouched]), f"{spec.name} {s.name} wrote outside its slots"
            assert not np.array_equal(got[~untouched], past[~untouched]), f"{spec.name} {s.name} wrote nothing"
    return errors


@pytest.fixture(scope="module")
def eager_models(exported_pair):
    target, draft = load_pair(exported_pair.target_dir, exported_pair.draft_dir)
    return target, draft, exported_pair.manifest.dims()


# --- tests -----------------------------------------------------------------------------------------


def test_bindings_of_every_graph_equal_the_contract(exported_pair):
    """Guards against an exporter that renames, drops (e.g. an input it found unused), reorders
    or re-types a binding, or leaves a dynamic dim unnamed: the engines and runtime bind by these names."""
    out, manifest = exported_pair.out, exported_pair.manifest
    dims = manifest.dims()
    assert SHORT == (3,) and dims.verify_proposals == manifest.verify_proposals == (3, 7)
    assert tuple(manifest.graphs) == EXPORTED
    assert {"verify_argmax_3_p3", "verify_sample_1_p3"} <= set(EXPORTED) and "target_verify_2_p3" in GRAPHS
    for name in EXPORTED:
        assert_bindings_equal_contract(out / manifest.graphs[name].file, contract.graph_spec(dims, name))


def test_graphs_pass_checker_and_use_only_standard_opset_24(exported_pair):
    """Guards against graphs ONNX Runtime / TensorRT refuse (IR 14, custom domains or functions, a
    cache written twice or not straight into its present output) and against KV writes / attention
    silently traced as generic ops (ScatterND, MatMul+Softmax)."""
    out, manifest = exported_pair.out, exported_pair.manifest
    dims = manifest.dims()
    for name, graph in manifest.graphs.items():
        onnx.checker.check_model(str(out / graph.file), full_check=True)
        model = onnx.load(str(out / graph.file))
        assert model.ir_version <= 13
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 24)]
        assert not model.functions and {node.domain for node in model.graph.node} == {""}
        ops = collections.Counter(node.op_type for node in model.graph.node)
        assert "ScatterND" not in ops, name
        kind = graph.io.kind
        writes = {
            contract.TARGET_MODEL: 2 * dims.target_layers,
            contract.DRAFT_MODEL: 2 * dims.draft_layers,  # context rows and block fused: one write per cache
        }.get(kind, 0)
        attentions = {contract.TARGET_MODEL: dims.target_layers, contract.DRAFT_MODEL: dims.draft_layers}
        assert ops["TensorScatter"] == writes, name
        outputs = {o.name for o in model.graph.output}
        scatters = [node for node in model.graph.node if node.op_type == "TensorScatter"]
        # TensorRT's KV-cache update must feed a graph output: each cache written once, straight out.
        assert all(node.output[0] in outputs and node.input[0].startswith("past_") for node in scatters), name
        assert ops["Attention"] == attentions.get(kind, 0), name
        # Sampling for 150k vocabularies in TensorRT: no sort, one TopK (K <= 3840), no bit operations, and
        # no cumulative sum but the verdict's (over the P proposals).
        assert not {"BitShift", "BitwiseAnd", "BitwiseXor", "BitwiseOr"} & set(ops), name
        assert ops["TopK"] == (kind in (contract.SAMPLE, contract.VERIFY_SAMPLE)), name
        assert ops["CumSum"] == (kind in (contract.VERIFY_ARGMAX, contract.VERIFY_SAMPLE)), name


def test_onnx_runtime_exports_attend_over_live_slots_with_fused_norms(exported_pair, tmp_path):
    """Guards against the export's rewrites silently doing nothing (a speed loss no equality test sees): in an
    ONNX Runtime export (``live_keys``) every Attention reads K and V through the slice to the live slots, and no
    norm is left as ``x * Reciprocal(Sqrt(v))``: after ONNX Runtime's own optimizer each norm of the target and
    the draft is one SimplifiedLayerNormalization (it fuses only ``x / Sqrt(v)``)."""
    out, manifest = exported_pair.out, exported_pair.manifest
    for name in (contract.TARGET_MODEL, contract.DRAFT_MODEL):
        model = onnx.load(str(out / manifest.graphs[name].file), load_external_data=False)
        ops = collections.Counter(node.op_type for node in model.graph.node)
        attentions = [node.name for node in model.graph.node if node.op_type == "Attention"]
        assert attentions and graph_passes.live_key_slices(model) == attentions, name
        assert ops["Reciprocal"] == 0 and ops["Div"] >= ops["ReduceMean"] > 0, name
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        ort.InferenceSession(str(out / manifest.graphs[name].file), options, providers=["CPUExecutionProvider"])
        optimized = collections.Counter(node.op_type for node in onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph.node)
        assert optimized["SimplifiedLayerNormalization"] == ops["ReduceMean"] and optimized["Sqrt"] == 0, (name, optimized)


def test_divide_by_root_rewrites_norm_products_only():
    """Guards against the norm rewrite changing a graph's math or touching a reciprocal that is not a norm's: of
    ``x * (1 / sqrt(v))``, ``x + 1 / sqrt(w)`` and ``(1 / sqrt(u))²`` only the first becomes ``x / sqrt(v)``, and
    ONNX Runtime computes the same outputs before and after."""
    import onnx_ir as ir
    from onnx import TensorProto, helper

    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4])
    nodes = [helper.make_node("Sqrt", [v], [f"{v}_root"]) for v in "vwu"]
    nodes += [helper.make_node("Reciprocal", [f"{v}_root"], [f"{v}_inverse"]) for v in "vwu"]
    nodes += [
        helper.make_node("Mul", ["x", "v_inverse"], ["norm"]),
        helper.make_node("Add", ["x", "w_inverse"], ["sum"]),
        helper.make_node("Mul", ["u_inverse", "u_inverse"], ["square"]),
    ]
    graph = helper.make_graph(nodes, "g", [value(n) for n in "xvwu"], [value(n) for n in ("norm", "sum", "square")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    rewritten = ir.from_proto(model)
    assert graph_passes.divide_by_root(rewritten.graph) == 1
    after = ir.to_proto(rewritten)
    onnx.checker.check_model(after, full_check=True)
    assert [o.name for o in after.graph.output] == ["norm", "sum", "square"]
    assert collections.Counter(n.op_type for n in after.graph.node) == {"Sqrt": 3, "Reciprocal": 2, "Div": 1, "Add": 1, "Mul": 1}
    feeds = {n: np.random.default_rng(0).uniform(0.5, 2.0, (2, 4)).astype(np.float32) for n in "xvwu"}
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds) for m in (model, after)]
    for before, now in zip(*runs):
        np.testing.assert_allclose(now, before, rtol=1e-6)


def routed(spec: contract.GraphSpec, dims: contract.Dims, feeds: dict) -> tuple[str, dict]:
    """(exported graph, its feeds) computing run graph ``spec`` on ``feeds``: the contract's feeding rules."""
    kind = spec.kind
    if kind in (contract.TARGET_PREFILL, contract.TARGET_VERIFY, contract.TARGET_DECODE):
        tokens = feeds[contract.TOKENS].shape[1]
        picks = {contract.TARGET_PREFILL: [tokens - 1], contract.TARGET_DECODE: [0]}.get(kind, range(tokens))  # verify: 0..k
        return contract.TARGET_MODEL, feeds | {contract.PICKS: np.array(list(picks), np.int64)}
    if kind == contract.DRAFT_CONTEXT:
        caches = {k: v for k, v in feeds.items() if k.startswith("past_")}
        count = np.array([feeds[contract.TAPS].shape[1]], np.int64)
        context = {contract.CTX_TAPS: feeds[contract.TAPS], contract.CTX_START: feeds[contract.START], contract.CTX_COUNT: count}
        return contract.DRAFT_MODEL, caches | context | {contract.ANCHOR: np.array([contract.NO_ANCHOR], np.int64)}
    return contract.exported_as(spec.name), feeds


def run_routed(graph: ort.InferenceSession, spec: contract.GraphSpec, dims: contract.Dims, feeds: dict) -> dict:
    """Run graph ``spec``'s outputs, computed by its exported graph's session."""
    _, inputs = routed(spec, dims, feeds)
    outputs = dict(zip([o.name for o in graph.get_outputs()], graph.run(None, inputs)))
    return {s.name: outputs[s.name].reshape(s.resolve({})) if s.name == contract.LOGITS else outputs[s.name] for s in spec.outputs}


@pytest.mark.parametrize("name", GRAPHS)
def test_onnx_runtime_equals_eager_fp32(exported_pair, eager_models, name):
    """Guards against any divergence between a traced graph and its PyTorch wrapper (attention
    alignment, lengths, GQA, RoPE positions, draft padding, sampling/verdict lowering, TopK ties) and
    against a cache write that touches any slot but the ones meant (whole caches compared) — for
    every run graph as its model network computes it (picks, draft_context's count and absent
    anchor: a block written past the context would show as a write outside its slots)."""
    target, draft, dims = eager_models
    out, manifest = exported_pair.out, exported_pair.manifest
    spec = contract.graph_spec(dims, name)
    module = graph_module(spec, target, draft, dims)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    graph = session(out / manifest.graphs[contract.exported_as(name)].file)
    for _ in range(2):
        feeds, written = random_inputs(spec, dims, rng)
        compare(spec, feeds, written, run_routed(graph, spec, dims, feeds), run_eager(module, spec, feeds), FP32_TOLERANCE)


def test_draft_context_at_the_end_of_the_cache_writes_its_rows_only(exported_pair, eager_models):
    """Guards against draft_model's write window reaching past the cache when a prompt ends near
    max_context (its block would not fit: start + C + B > L), and against the absent block being
    written anyway: the context rows land, every other slot keeps its value."""
    target, draft, dims = eager_models
    spec = contract.graph_spec(dims, contract.DRAFT_CONTEXT)
    graph = session(exported_pair.out / exported_pair.manifest.graphs[contract.DRAFT_MODEL].file)
    rng = np.random.default_rng(5)
    for rows in (1, dims.max_chunk):
        start = dims.max_context - rows
        feeds = _caches(spec, rng, np.float32) | {
            contract.TAPS: rng.standard_normal((1, rows, dims.tap_width)).astype(np.float32),
            contract.START: np.array([start]),
        }
        want = run_eager(graph_module(spec, target, draft, dims), spec, feeds)
        compare(spec, feeds, [(start, start + rows)], run_routed(graph, spec, dims, feeds), want, FP32_TOLERANCE)


def test_onnx_kernels_eager_formulation_equals_eager_kernels():
    """Guards against a wrong ONNX formulation (is_causal bottom-right offset, lengths, window
    mask, TensorScatter slots) independently of ONNX Runtime: OnnxKernels' PyTorch model of the
    ONNX ops must equal the reference kernels."""
    torch.manual_seed(0)
    n, hq, hkv, L, D, T = 3, 4, 2, 24, 8, 5
    start = torch.tensor([0, 7, 19])
    rows = torch.arange(n)
    positions = start[:, None] + torch.arange(T)
    q, new = torch.randn(n, hq, T, D), torch.randn(n, hkv, T, D)
    for causal, window in ((True, 0), (True, 4), (False, 0)):
        for mode in ("lengths", CAUSAL_MASK):
            k, v = torch.randn(n, hkv, L, D), torch.randn(n, hkv, L, D)
            onnx_kernels, eager = OnnxKernels(mode), EagerKernels()
            k_onnx = onnx_kernels.write_cache(k, rows, start, new)
            k_eager = eager.write_cache(k.clone(), rows, start, new)
            assert torch.equal(k_onnx, k_eager)
            want = eager.attention(q, k_eager, v, rows, positions, start + T, causal, window)
            got = onnx_kernels.attention(q, k_onnx, v, rows, positions, start + T, causal, window)
            assert torch.allclose(got, want, atol=1e-6), (causal, window, mode)


@pytest.fixture(scope="module")
def windowed_pair(tmp_path_factory, tiny_pair):
    """A Qwen3 target with alternating full / sliding-window (6) layers, and tiny_pair's draft."""
    import tiny_models

    directory = tmp_path_factory.mktemp("windowed") / "target"
    layer_types = ["full_attention", "sliding_attention"] * 2 + ["full_attention"]
    tiny_models.write_target(directory, sliding_window=6, use_sliding_window=True, layer_types=layer_types)
    return directory, tiny_pair[1]


@pytest.mark.parametrize("case", ["window-layers", "causal-mask"])
def test_target_mask_formulations_in_onnx_runtime(tmp_path, tiny_pair, windowed_pair, case):
    """Guards against the boolean-mask path (sliding-window layers, and --causal mask for backends
    that ignore nonpad_kv_seqlen or align is_causal top-left, e.g. TensorRT-RTX) diverging from the
    wrapper in ONNX Runtime, for the target's causal mask and the draft's length mask."""
    target_dir, draft_dir = windowed_pair if case == "window-layers" else tiny_pair
    causal = "lengths" if case == "window-layers" else CAUSAL_MASK
    options = ExportOptions(max_owners=2, max_context=48, dtype="fp32", causal=causal).resolve(target_dir, draft_dir)
    target, draft = load_pair(target_dir, draft_dir)
    dims = contract_dims(target, draft, options)
    rng = np.random.default_rng(7)
    for name in ("target_verify_2",) if case == "window-layers" else ("target_verify_2", "draft_2"):
        spec = contract.graph_spec(dims, name)
        with kernels_of([target, draft], OnnxKernels(causal, emit=True)):
            graph = export_graph(graph_module(spec, target, draft, dims), spec, tmp_path)
        assert_bindings_equal_contract(tmp_path / graph.file, spec)
        feeds, written = random_inputs(spec, dims, rng)
        ours = dict(zip(spec.output_names, session(tmp_path / graph.file).run(None, feeds)))
        compare(spec, feeds, written, ours, run_eager(graph_module(spec, target, draft, dims), spec, feeds), FP32_TOLERANCE)


@pytest.fixture(scope="module")
def half_exports(tmp_path_factory, exported_pair):
    """fp16 and bf16 exports of target_verify_2 and draft_2 (both models, all cache kernels), no manifest."""
    target_dir, draft_dir = exported_pair.target_dir, exported_pair.draft_dir
    result = {}
    for dtype in ("fp16", "bf16"):
        out = tmp_path_factory.mktemp(dtype)
        options = ExportOptions(max_owners=2, max_context=64, dtype=dtype).resolve(target_dir, draft_dir)
        target, draft = load_pair(target_dir, draft_dir, TORCH_DTYPES[DTYPES[dtype]])
        dims = contract_dims(target, draft, options)
        names = ("target_verify_2", "draft_2")
        started = time.perf_counter()
        with kernels_of([target, draft], OnnxKernels(emit=True)):
            files = {n: export_graph(graph_module(contract.graph_spec(dims, n), target, draft, dims), contract.graph_spec(dims, n), out) for n in names}
        result[dtype] = (out, dims, files, target, draft, time.perf_counter() - started)
    return result


@pytest.mark.parametrize("name", ["target_verify_2", "draft_2"])
def test_onnx_runtime_equals_eager_fp16(half_exports, name):
    """Guards against dtype bugs in the one export code path (casts, fp32 logits, cache dtype,
    RMSNorm/RoPE precision): the fp16 graph in ONNX Runtime tracks the fp16 wrapper in PyTorch
    within fp16 tolerance, logits stay fp32, and cache writes stay in their slots."""
    out, dims, files, target, draft, _ = half_exports["fp16"]
    spec = contract.graph_spec(dims, name)
    assert_bindings_equal_contract(out / files[name].file, spec)
    feeds, written = random_inputs(spec, dims, np.random.default_rng(11))
    ours = dict(zip(spec.output_names, session(out / files[name].file).run(None, feeds)))
    theirs = run_eager(graph_module(spec, target, draft, dims), spec, feeds)
    if contract.LOGITS in ours:
        assert ours[contract.LOGITS].dtype == np.float32
    compare(spec, feeds, written, ours, theirs, 2e-2)


def test_bf16_graphs_pass_checker_with_bf16_bindings(half_exports):
    """Guards against a bf16 export (what TensorRT builds) that is malformed or mistyped; ONNX
    Runtime CPU cannot run bf16 (no bf16 kernels), so it is checked, not run, here."""
    out, dims, files, _, _, _ = half_exports["bf16"]
    assert dims.dtype == "bfloat16"
    for name, graph in files.items():
        onnx.checker.check_model(str(out / graph.file), full_check=True)
        assert_bindings_equal_contract(out / graph.file, contract.graph_spec(dims, name))


def test_draft_wrapper_equals_context_write_then_reference_proposal(eager_models):
    """Guards against the fused context+block cache write of draft_n (one write per cache, as
    TensorRT requires) diverging from the reference: write_context of the real rows, then the
    block forward (ReferenceDecoder._propose); edge cases: no context, a full block of context,
    the block at the very start and at the very end of the cache."""
    target, draft, dims = eager_models
    B, L, P = dims.block_size, dims.max_context, dims.proposals
    wrapper = graph_module(contract.graph_spec(dims, "draft_3"), target, draft, dims)
    rng = np.random.default_rng(3)
    for ctx_start, count in (([0, 5, L - 2 * B], [0, 3, B]), ([2, L - B - 1, 0], [B, 1, 0])):
        ctx_start, count = torch.tensor(ctx_start), torch.tensor(count)
        taps = torch.from_numpy(rng.standard_normal((3, B, dims.tap_width)).astype(np.float32))
        taps[torch.arange(B)[None, :] >= count[:, None]] = 0
        anchor = torch.tensor([4, 50, 96])
        keys, values = draft.new_cache(3, L)
        for cache in keys + values:
            cache.normal_()
        want_keys, want_values = [k.clone() for k in keys], [v.clone() for v in values]
        with torch.no_grad():
            for i in range(3):
                row = torch.tensor([i])
                draft.write_context(taps[i : i + 1, : int(count[i])], ctx_start[i : i + 1], row, want_keys, want_values)
            masks = torch.full((3, B - 1), draft.config.mask_token_id)
            hidden = draft(target.embed(torch.cat([anchor[:, None], masks], 1)), ctx_start + count, torch.arange(3), want_keys, want_values)
            want = target.head(hidden[:, 1 : P + 1]).argmax(-1)
            got, *caches = wrapper(taps, ctx_start, count, anchor, *[t for pair in zip(keys, values) for t in pair])
        assert torch.equal(got, want)
        for cache, expected in zip(caches, [t for pair in zip(want_keys, want_values) for t in pair]):
            assert torch.allclose(cache, expected, atol=1e-5, rtol=1e-5)  # batching: ulp-level


def test_shared_weights_store_each_tensor_once_and_run(tmp_path, exported_pair, eager_models):
    """Guards against an export of a real model writing the target's weights once per graph (an 8B
    target at max_owners 4 would take ~90 GB) and against shared external data that ONNX Runtime
    cannot read or reads at the wrong offsets."""
    from dflash_trt.export.weights import WEIGHTS_FILE, SharedWeights

    target, draft, dims = eager_models
    names = ("target_verify_1", "target_verify_2", "draft_1")
    with SharedWeights(tmp_path) as weights, kernels_of([target, draft], OnnxKernels(emit=True)):
        files = {n: export_graph(graph_module(contract.graph_spec(dims, n), target, draft, dims), contract.graph_spec(dims, n), tmp_path, weights) for n in names}
    assert all(list(f.data_files) == [WEIGHTS_FILE] for f in files.values())
    parameters = sum(p.numel() * 4 for p in list(target.parameters()) + list(draft.parameters()))
    assert weights.stored_bytes <= parameters + 4 * dims.draft_layers * 64 * 64  # once, plus few folded copies
    assert weights.shared_bytes >= weights.stored_bytes / 2  # target_verify_2 reuses target_verify_1's tensors
    rng = np.random.default_rng(9)
    for name, graph in files.items():
        spec = contract.graph_spec(dims, name)
        onnx.checker.check_model(str(tmp_path / graph.file), full_check=True)
        feeds, written = random_inputs(spec, dims, rng)
        ours = dict(zip(spec.output_names, session(tmp_path / graph.file).run(None, feeds)))
        compare(spec, feeds, written, ours, run_eager(graph_module(spec, target, draft, dims), spec, feeds), FP32_TOLERANCE)
