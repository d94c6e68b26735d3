"""The parts of ``dflash-trt selfcheck`` that run without a GPU.

Engine execution itself needs a GPU TensorRT supports (not this machine):
here the feeds, the ONNX Runtime reference over pointer-bound buffers, the
comparison and the no-GPU refusal are checked.
"""

from __future__ import annotations

import pytest
import torch
from onnx import TensorProto as TP

from dflash_trt import cli
from dflash_trt.engines.selfcheck import (
    cache_aliases,
    compare,
    dynamic_sizes,
    random_feeds,
    require_gpu,
    run_reference,
)
from dflash_trt.engines.sources import export_sources
from dflash_trt.errors import EngineError
from dflash_trt.export import contract
from dflash_trt.export.contract import DimRange, GraphSpec, TensorSpec
from test_engines_build import TOKENS, kv_attention_model, source

IO = GraphSpec(
    "g",
    "synthetic",
    None,
    (
        TensorSpec("tokens", (2, "n"), "int64"),
        TensorSpec("hidden", (2, "n", 8), "bfloat16"),
        TensorSpec("mask", (2, 4), "bool"),
    ),
    (TensorSpec("logits", (2, "n", 5), "float16"), TensorSpec("argmax", (2,), "int64")),
    {"n": DimRange(1, 3, 7)},
)


def test_random_feeds_follow_the_contract_at_the_opt_shape():
    """Guards against feeding an engine shapes outside its profile, integer
    values outside [low, high), or a chunk that with its start overruns the
    cache (out-of-bounds reads/writes on the GPU)."""
    feeds = random_feeds(IO, seed=0, int_range=(1, 3))
    assert {k: (tuple(v.shape), v.dtype) for k, v in feeds.items()} == {
        "tokens": ((2, 3), torch.int64),
        "hidden": ((2, 3, 8), torch.bfloat16),
        "mask": ((2, 4), torch.bool),
    }
    assert set(feeds["tokens"].unique().tolist()) <= {1, 2}
    assert 0.0 <= float(feeds["hidden"].min()) and float(feeds["hidden"].max()) <= 1.0
    assert torch.equal(random_feeds(IO, 0, (1, 3))["hidden"], feeds["hidden"])
    # A chunk as long as the cache leaves room for the largest start fed (2).
    chunk = GraphSpec("p", "synthetic", None, IO.inputs, IO.outputs, {"n": DimRange(1, 64, 64)})
    assert dynamic_sizes(chunk, (1, 3)) == {"n": 62}


def test_compare_flags_float_drift_and_any_integer_difference():
    """Guards against a comparison that passes everything (or fails on rounding)."""
    want = {"logits": torch.zeros(2, 3, 5, dtype=torch.float16), "argmax": torch.tensor([1, 2])}
    close = {"logits": want["logits"] + 0.005, "argmax": want["argmax"].clone()}
    assert all(c.ok for c in compare("e", IO, close, want))
    far = {"logits": want["logits"] + 0.5, "argmax": torch.tensor([1, 3])}
    checks = {c.output: c for c in compare("e", IO, far, want)}
    assert not checks["logits"].ok and "0.5" in checks["logits"].detail
    assert not checks["argmax"].ok and checks["argmax"].detail == "1 of 2 elements differ"


def test_fp32_logits_of_a_bf16_graph_are_held_to_bf16_rounding():
    """Guards against false selfcheck failures: a bf16 graph's logits are fp32 tensors
    computed in bf16, so they carry bf16 rounding; they were compared at fp32's 1e-3. The
    tolerance is the coarser of the output's dtype and its graph's; an fp32 graph keeps 1e-3."""
    def graph(dtype: str) -> GraphSpec:
        inputs = (TensorSpec("tokens", (1, 4), "int64"), TensorSpec("past_key_0", (1, 1, 8, 4), dtype))
        return GraphSpec("g", "synthetic", None, inputs, (TensorSpec("logits", (1, 4, 5), "float32"),))

    want = {"logits": torch.zeros(1, 4, 5)}
    got = {"logits": want["logits"] + 0.02}
    (bf16,) = compare("verify", graph("bfloat16"), got, want)
    (fp32,) = compare("verify", graph("float32"), got, want)
    assert bf16.ok and "rtol 0.05" in bf16.detail
    assert not fp32.ok and "rtol 0.001" in fp32.detail


def test_onnxruntime_reference_runs_the_graph_through_bound_buffers(tmp_path):
    """Guards against the reference side binding wrong dtypes/shapes by
    pointer: the fp16 KV-write + attention graph must run, write the new rows
    into the cache at the write index and match itself."""
    src = source(tmp_path, "g", kv_attention_model(TP.FLOAT16, tokens="tokens"), {"tokens": TOKENS})
    feeds = random_feeds(src.io, seed=1, int_range=(1, 3))
    out = run_reference(src, feeds)
    row = int(feeds["write_index"][0])
    assert torch.equal(out["k_cache_out"][0, :, row : row + TOKENS.opt], feeds["k"][0])
    assert torch.equal(out["k_cache_out"][0, :, :row], feeds["k_cache"][0, :, :row])
    assert out["out"].shape == (1, 2, TOKENS.opt, 16) and torch.isfinite(out["out"].float()).all()
    assert all(c.ok for c in compare("g", src.io, out, run_reference(src, feeds)))


def test_selfcheck_without_a_gpu_says_so(tmp_path, capsys):
    """Guards against a TensorRT/CUDA traceback on a CPU-only machine."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(EngineError, match="needs|none is visible"):
        require_gpu()
    assert cli.main(["selfcheck", "--engines", str(tmp_path), "--onnx", str(tmp_path)]) == 1
    assert "none is visible here" in capsys.readouterr().err


def test_random_feeds_are_valid_inputs_of_every_exported_graph(exported_pair):
    """Guards against selfcheck feeding a real graph values it cannot take
    (a write index past the cache, a token id past the vocabulary: a crash or
    NaNs on both sides would make the comparison meaningless), and against
    cache outputs bound to the wrong input buffer."""
    directory = exported_pair[2]
    sources, _manifest = export_sources(directory)
    for source in sources:
        aliases = cache_aliases(source.io)
        specs = {s.name: s for s in source.io.inputs + source.io.outputs}
        assert all(specs[present].shape == specs[past].shape for present, past in aliases.items())
        assert set(aliases) == {s.name for s in source.io.outputs if s.name.startswith("present_")}
        out = run_reference(source, random_feeds(source.io, seed=0, int_range=(1, 3), block=exported_pair.manifest.block_size))
        assert set(out) == {s.name for s in source.io.outputs}
        floats = [t for t in out.values() if t.dtype.is_floating_point]
        assert all(torch.isfinite(t).all() for t in floats), source.name


def test_every_profile_writes_at_another_start_per_owner_the_last_at_the_caches_end(exported_pair):
    """Guards against a selfcheck blind to TensorRT's lower-right diagonal anchored at the padded
    cache length: with every owner at the same small start the per-row and the padded readings
    can agree. Every profile of both model graphs feeds each owner another start, none at 0,
    the last one's rows (the draft's context rows and block) ending exactly at the cache's end."""
    manifest = exported_pair.manifest
    length, block = manifest.max_context, manifest.block_size
    sources, _ = export_sources(exported_pair.out)
    for graph in (s for s in sources if s.name in (contract.TARGET_MODEL, contract.DRAFT_MODEL)):
        for profile in contract.profiles_of(graph.io):
            feeds = random_feeds(graph.io, 0, (1, 3), profile.dims, block)
            if graph.name == contract.TARGET_MODEL:
                starts, span = feeds[contract.START].tolist(), feeds[contract.TOKENS].shape[1]
            else:
                starts, span = feeds[contract.CTX_START].tolist(), feeds[contract.CTX_TAPS].shape[1] + block
                assert feeds[contract.CTX_COUNT].tolist()[0] == feeds[contract.CTX_TAPS].shape[1], profile.graph
            assert len(set(starts)) == len(starts) and min(starts) > 0, (profile.graph, starts)
            assert starts[-1] + span == length, (profile.graph, starts, span)
