"""The fast path (runtime/kernels): launch plans, the pure-torch twin, fused weights, and the backend switch.

CPU: the twin (``TorchOps``) against the reference modules of ``export.layers``
and, through ``TorchBackend(kernels="fast")``, every contract graph against
the eager backend. Where Triton is importable without a GPU, its interpreter
runs the Triton kernels against the twin. GPU (``-m gpu``): the Triton
kernels against the twin and the reference on CUDA, fp32 and bf16, and the
fast bf16 graphs against the eager bf16 graphs on the shipped pair.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.errors import EngineError
from dflash_trt.export import contract as c
from dflash_trt.export.config import AttentionConfig, RopeConfig
from dflash_trt.export.layers import EAGER, Attention, DecoderLayer, RMSNorm, Rotary, SwiGLU
from dflash_trt.export.pair import load_pair
from dflash_trt.runtime.backends import TorchBackend
from dflash_trt.runtime.kernels.fused import fuse_layer
from dflash_trt.runtime.kernels.plan import attention_plan, split_range
from dflash_trt.runtime.kernels.torch_ops import TorchOps

from test_backends import ROWS, assert_same_outputs, assert_same_pools, fill_pools, pool_state, run_script, script

gpu = pytest.mark.gpu
TRITON = importlib.util.find_spec("triton") is not None


def _config(heads=4, kv_heads=2, head_dim=16, hidden=48, intermediate=40, bias=False, qk_norm=True) -> AttentionConfig:
    return AttentionConfig(
        vocab_size=50, hidden_size=hidden, intermediate_size=intermediate, num_layers=1, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0),
        attention_bias=bias, mlp_bias=bias, qk_norm=qk_norm, windows=(0,),
    )


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


# ------------------------------------------------------------------ plans


def test_split_ranges_cover_the_valid_slots_exactly_once():
    """Bug: the split-K attention skips or double-counts slots at split edges (wrong attention weights),
    or a split reaches past kv_len into stale slots."""
    for lo, hi, splits, block in itertools.product((0, 3, 17), (0, 5, 64, 100, 129), (1, 2, 3, 7, 32), (16, 64)):
        seen = []
        for s in range(splits):
            a, b = split_range(lo, hi, s, splits, block)
            assert (a - lo) % block == 0
            seen += list(range(a, b))
        assert seen == list(range(lo, max(hi, lo))), (lo, hi, splits, block)


def test_attention_plan_does_not_grow_with_max_context():
    """Bug: the plan (program count, split count) depends on max_context, so a 16-token verify pays for
    every slot of a long pool instead of the valid ones."""
    for owners, tokens in ((1, 1), (4, 1), (1, 16), (4, 16)):
        plans = {attention_plan(owners, 8, 4, tokens, 128, L, 132) for L in (4096, 16384, 65536)}
        assert len(plans) == 1, plans
    assert attention_plan(1, 8, 4, 1, 128, 4096, 132).splits > 1  # decode: the slots are split across the chip


# ------------------------------------------------------------------ the twin vs the reference modules


@pytest.mark.parametrize("causal,window", [(True, 0), (False, 0), (True, 5)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_twin_attention_equals_eager_attention(causal, window, tokens):
    """Bug: the split attention's log-sum-exp combine, its empty splits or its causal/window bounds give
    other weights than the masked reference (stale slots past kv_len must never count)."""
    generator = torch.Generator().manual_seed(tokens)
    n, heads, kv_heads, D, L = 3, 6, 2, 16, 96
    q = torch.randn(n, heads, tokens, D, generator=generator)
    k, v = torch.randn(n, kv_heads, L, D, generator=generator), torch.randn(n, kv_heads, L, D, generator=generator)
    start = torch.tensor([0, 13, 70])
    positions = start[:, None] + torch.arange(tokens)
    expected = EAGER.attention(q, k, v, None, positions, start + tokens, causal, window)
    for splits in (1, 2, 5, 32):  # 32 splits: most are empty
        got = TorchOps(splits).attention(q, k, v, None, positions, start + tokens, causal, window)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"splits {splits}")


def test_twin_linear_equals_norm_linear_swiglu_and_residual():
    """Bug: the RMSNorm prologue (per-row scale after the GEMM), the gate|up SiLU epilogue, bias or the
    in-place residual add differ from RMSNorm -> Linear -> SwiGLU of the reference modules."""
    config = _config(bias=True)
    norm, mlp = _randomize(RMSNorm(config.hidden_size, 1e-6), 1), _randomize(SwiGLU(config), 2)
    x = torch.randn(5, config.hidden_size)
    ops = TorchOps()
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
    gate_up_bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach()
    with torch.no_grad():
        h = ops.linear(x, gate_up, bias=gate_up_bias, norm=norm.weight, eps=norm.eps, gated=True)
        torch.testing.assert_close(h, F.silu(mlp.gate_proj(norm(x))) * mlp.up_proj(norm(x)), atol=1e-5, rtol=1e-5)
        residual, tap = x.clone(), torch.zeros(5, 2 * config.hidden_size)
        out = ops.linear(h, mlp.down_proj.weight, bias=mlp.down_proj.bias, residual=residual, out=residual, tap=tap[:, 3:3 + config.hidden_size])
        expected = x + mlp(norm(x))
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tap[:, 3:3 + config.hidden_size], expected)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_twin_rope_write_equals_attention_projections(qk_norm):
    """Bug: the fused q/k-norm + RoPE + KV write rotates the wrong halves, norms with the wrong weight,
    uses another position than its slot, or writes K/V to other slots or rows."""
    config = _config(qk_norm=qk_norm)
    attn = _randomize(Attention(config), 3)
    rotary = Rotary(config.rope, config.head_dim)
    n, T, L = 2, 3, 20
    x, start = torch.randn(n, T, config.hidden_size), torch.tensor([4, 11])
    k_cache, v_cache = torch.randn(n, config.num_kv_heads, L, 16), torch.randn(n, config.num_kv_heads, L, 16)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    with torch.no_grad():
        cos, sin = rotary(start[:, None] + torch.arange(T), x.dtype)
        q = attn.query(x, cos, sin)
        k, v = attn.key_value(x, cos, sin)
        EAGER.write_cache(expected_k, None, start, k)
        EAGER.write_cache(expected_v, None, start, v)
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        got = TorchOps().qk_rope_write(
            x.reshape(n * T, -1) @ qkv.T, start, T, config.num_heads, config.num_kv_heads, 16,
            attn.q_norm.weight if qk_norm else None, attn.k_norm.weight if qk_norm else None, 1e-6, rotary.inv_freq, k_cache, v_cache,
        )
    torch.testing.assert_close(got.transpose(1, 2), q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, expected_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache, expected_v, atol=1e-5, rtol=1e-5)


def test_fused_weights_are_views_of_the_layer_parameters():
    """Bug: fusing at load copies the weights (twice the GPU memory) or changes what the reference
    modules compute on the same model."""
    layer = _randomize(DecoderLayer(_config(bias=True), causal=True), 4)
    x = torch.randn(2, 3, 48)
    before = layer.mlp(x)
    fused = fuse_layer(layer)
    attn, mlp = layer.self_attn, layer.mlp
    for module, tensor in ((attn.q_proj, fused.qkv), (attn.v_proj, fused.qkv), (mlp.up_proj, fused.gate_up)):
        assert module.weight.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    assert attn.k_proj.bias.untyped_storage().data_ptr() == fused.qkv_bias.untyped_storage().data_ptr()
    torch.testing.assert_close(layer.mlp(x), before, atol=0, rtol=0)
    again = fuse_layer(layer)  # a second backend over the same model: no second copy
    assert again.qkv.data_ptr() == fused.qkv.data_ptr() and again.gate_up.data_ptr() == fused.gate_up.data_ptr()
    assert again.qkv_bias.data_ptr() == fused.qkv_bias.data_ptr() and torch.equal(again.qkv, fused.qkv)
    torch.testing.assert_close(fused.kv, torch.cat([attn.k_proj.weight, attn.v_proj.weight]), atol=0, rtol=0)


# ------------------------------------------------------------------ the backend switch


@pytest.fixture(scope="module")
def fast_pair(exported_pair):
    return exported_pair.target_dir, exported_pair.draft_dir, exported_pair.out, exported_pair.manifest.dims()


def test_fast_graphs_equal_eager_graphs_on_cpu(fast_pair):
    """Bug: a fast graph module computes or writes something else than the contract's reference module
    (fused weights, taps, the draft's context-then-block write, the last-row head of the prefill)."""
    target_dir, draft_dir, out, dims = fast_pair
    with TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=ROWS, kernels="eager") as eager, \
            TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=ROWS, kernels="fast") as fast:
        assert (eager.kernels, fast.kernels) == ("eager", "fast")
        for backend in (eager, fast):
            fill_pools(backend, seed=5)
        a, b = run_script(eager, dims), run_script(fast, dims)
        assert_same_outputs(a, b, script(dims), atol=1e-4)
        assert_same_pools(pool_state(eager), pool_state(fast), atol=1e-4)


def test_row_indexed_runs_equal_row_range_runs(fast_pair):
    """Bug: a program over cache rows given as a device tensor (any rows, any order, padded with the
    scratch row) reads or writes other rows than the same owners run one by one at their row views:
    a stranger's cache changed, or an owner attending over another's keys."""
    target_dir, draft_dir, out, dims = fast_pair
    P, B = dims.proposals, dims.block_size
    with TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=ROWS, kernels="fast") as indexed, \
            TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=ROWS, kernels="fast") as ranged:
        for backend in (indexed, ranged):
            fill_pools(backend, seed=9)
        g = torch.Generator().manual_seed(2)
        n, rows, scratch = dims.max_owners, [3, 1], ROWS  # n - 2 padded lanes at the scratch row
        tokens = torch.randint(0, dims.vocab_size, (n, P + 1), generator=g)
        start = torch.tensor([5, 9, 0, 0, 0][:n])
        slots = torch.tensor(rows + [scratch] * (n - 2))
        got = indexed.run_at(c.graph_name(c.TARGET_VERIFY, n), {c.TOKENS: tokens, c.START: start}, slots)
        taps = torch.randn(n, B, dims.tap_width, generator=g)
        feeds = {c.CTX_TAPS: taps, c.CTX_START: start, c.CTX_COUNT: torch.tensor([2, 3, 1, 1, 1][:n]), c.ANCHOR: tokens[:, 0].contiguous()}
        drafted = indexed.run_at(c.graph_name(c.DRAFT, n), feeds, slots)
        for i, row in enumerate(rows):
            one = ranged.run(c.graph_name(c.TARGET_VERIFY, 1), {c.TOKENS: tokens[i : i + 1], c.START: start[i : i + 1]}, row)
            torch.testing.assert_close(got[c.LOGITS][i], one[c.LOGITS][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got[c.TAPS][i], one[c.TAPS][0], atol=1e-4, rtol=1e-4)
            single = {name: value[i : i + 1] for name, value in feeds.items()}
            proposals = ranged.run(c.graph_name(c.DRAFT, 1), single, row)[c.PROPOSALS]
            assert torch.equal(drafted[c.PROPOSALS][i], proposals[0])
        assert_same_pools(pool_state(indexed), pool_state(ranged), atol=1e-4)  # row 0, 2, 5.. untouched in both


def test_fast_target_taps_the_last_layer_like_the_reference(tmp_path):
    """Bug: the fast target's tap of the last layer differs from the reference's (with TargetModel.tap_of,
    HF's hidden_states[-1]: the final-normed state; taps fused into the GEMM epilogue are residuals)."""
    import tiny_models

    from dflash_trt.export.target import load_target
    from dflash_trt.runtime.kernels.fused import FastTarget

    target_dir = tiny_models.write_target(tmp_path / "target", num_hidden_layers=3)
    reference = load_target(target_dir, tap_layers=(0, 2))
    fast = FastTarget(_randomize_norms(load_target(target_dir, tap_layers=(0, 2))), TorchOps())
    _randomize_norms(reference)
    tokens, start = torch.randint(0, tiny_models.VOCAB, (2, 5), generator=torch.Generator().manual_seed(3)), torch.tensor([0, 4])
    with torch.no_grad():
        _, want = reference.features(tokens, start, None, *reference.new_cache(2, 16))
        _, got = fast.features(tokens, start, *reference.new_cache(2, 16))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _randomize_norms(model):
    """Final-norm weights away from 1, so a missing final norm shows."""
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.linspace(0.5, 2.0, model.model.norm.weight.numel()))
    return model


def test_kernels_option_is_checked(fast_pair, caplog):
    """Bug: an unknown kernels value is ignored, or "auto" picks the CPU twin (a check, not a speed path),
    or "fast" runs a pair its kernels cannot (head_dim not a power of two); or the backend starts without
    saying which kernels it chose (the default differs by device and dtype)."""
    target_dir, draft_dir, out, dims = fast_pair
    with pytest.raises(EngineError, match="kernels must be one of"):
        TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=2, kernels="triton")
    with caplog.at_level("INFO", logger="dflash_trt.runtime.backends.torch_backend"), \
            TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=2) as backend:
        assert backend.kernels == "eager"  # auto on the CPU
    assert f"torch backend on cpu, {dims.dtype}, kernels eager" in caplog.text
    target, draft = load_pair(target_dir, draft_dir)
    object.__setattr__(target.config, "head_dim", 12)  # as a checkpoint with head_dim 12 would read
    with pytest.raises(EngineError, match="head_dim must be a power of two"):
        TorchBackend(target, draft, dataclasses.replace(dims, target_head_dim=12), 2, kernels="fast")


def test_fp8_rows_keep_every_weight_within_e4m3_rounding():
    """Bug: the draft's fp8 quantizer loses a row (a scale from the whole tensor rather than the row: small rows
    flush to zero), overflows e4m3 (values past 448 become NaN), or divides by a zero scale on an all-zero row."""
    from dflash_trt.runtime.kernels.quant import FP8, FP8_MAX, dequantized, fp8_rows

    g = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 96, generator=g) * torch.logspace(-4, 2, 40)[:, None]  # rows six decades apart
    weight[7] = 0.0
    q, scale = fp8_rows(weight.to(torch.bfloat16))
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert not torch.isnan(q.float()).any() and q.float().abs().max() <= FP8_MAX
    assert torch.equal(q[7].float(), torch.zeros(96)) and scale[7] == 1.0
    back, want = dequantized(q, scale), weight.to(torch.bfloat16).float()
    tolerance = want.abs().amax(dim=1, keepdim=True) * 2.0**-4  # e4m3: 3 mantissa bits, below the normal range steps of 2^-9 amax
    assert ((back - want).abs() <= tolerance).all()
    torch.testing.assert_close(back.abs().amax(dim=1), want.abs().amax(dim=1), rtol=1e-6, atol=0)  # each row's largest: 448 x its scale
    with pytest.raises(ValueError, match="2-D"):
        fp8_rows(torch.zeros(4))


def test_draft_weights_option_is_checked(fast_pair):
    """Bug: an unknown ``draft_weights`` is ignored, or fp8 is accepted by kernels that have no fp8 products (the
    eager reference modules, or the fast Triton kernels) and silently runs the draft in the model's dtype."""
    target_dir, draft_dir, out, _ = fast_pair
    with pytest.raises(EngineError, match="draft_weights must be one of"):
        TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=2, kernels="fast", draft_weights="int4")
    with pytest.raises(EngineError, match="draft_weights='fp8' runs on the exact kernels.*got kernels='eager'"):
        TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=2, kernels="eager", draft_weights="fp8")


@pytest.mark.skipif(not TRITON, reason="needs triton (it ships with the CUDA builds of torch)")
def test_the_fast_triton_kernels_refuse_fp8_weights(fast_pair):
    """Bug: the fast Triton kernels (no fp8 products) are given the draft's fp8 weights and compute them as if they
    were the model's dtype (their scale dropped), through the backend or a direct ``linear`` call."""
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    target_dir, draft_dir, out, _ = fast_pair
    with pytest.raises(EngineError, match=r"draft_weights='fp8' runs on the exact kernels.*got kernels='fast' \(TritonOps\)"):
        TorchBackend.from_checkpoints(target_dir, draft_dir, out, max_sessions=2, kernels=TritonOps(), draft_weights="fp8")
    with pytest.raises(ValueError, match="no fp8 products"):
        TritonOps().linear(torch.zeros(2, 8), torch.zeros(4, 8), scale=torch.ones(4))


def test_an_fp8_draft_keeps_dflash_equal_to_plain_decoding():
    """Bug: the draft's weights in fp8 change what DFlash returns (the target must verify every token whatever the
    draft proposes), or break the draft (a scale applied to the wrong features, the head's copy wrong): the shipped
    pair's acceptance must stay within a tenth of the model-dtype draft's. fp32 target on the CPU twin, 8 held-out
    prompts x 64 tokens, 4 sessions, greedy."""
    import exact_checks

    from dflash_trt.export.exporter import ExportOptions, contract_dims
    from dflash_trt.export.pair import DEFAULT_PAIR_DIR
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.generate import collect, stream

    requests = exact_checks.default_pair_requests(8, 64)[:8]  # the greedy half
    options = ExportOptions(max_owners=4, max_sessions=4).resolve(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft")
    outputs, tau = {}, {}
    for weights in ("model", "fp8"):
        target, draft = load_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft")
        with TorchBackend(target, draft, contract_dims(target, draft, options), 4, kernels="fast", draft_weights=weights) as backend:
            for speculate in (False, True) if weights == "model" else (True,):
                with Executor(backend, max_sessions=4, speculate=speculate, policy="always") as executor:
                    outputs[weights, speculate] = [c.tokens for c in collect(stream(executor, requests, 4), len(requests))]
                    cycles = executor.cycle_stats()
                if speculate:
                    tau[weights] = (cycles["accepted"].sum() + len(cycles)) / len(cycles)
    for i, plain in enumerate(outputs["model", False]):
        assert outputs["fp8", True][i] == plain, f"request {i}: the fp8 draft's DFlash output differs from plain decoding"
        assert outputs["model", True][i] == plain, f"request {i}: DFlash output differs from plain decoding"
    assert tau["fp8"] >= 0.9 * tau["model"] > 1.5, tau


@pytest.mark.skipif(not TRITON, reason="needs triton (it ships with the CUDA builds of torch)")
def test_triton_interpreter_equals_the_twin():
    """Bug: a Triton kernel's indexing, masking or epilogue differs from the twin (checked without a GPU
    by Triton's interpreter, fp32)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); import torch, kernel_checks; "
        "kernel_checks.check_all('cpu', torch.float32, small=True)"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.skipif(not TRITON, reason="needs triton (it ships with the CUDA builds of torch)")
def test_overlapped_launches_are_asked_for_only_where_they_run(monkeypatch):
    """Bug: ops asked to overlap launches (``pdl=True``) on a device that cannot (the CPU, Triton's interpreter)
    launch anyway — Triton fails deep in its launcher, or the interpreter meets an instruction it lacks —
    instead of a typed error naming the field; or ops left to choose overlap launches where they cannot, or
    where they were turned off (``DFLASH_TRT_PDL=0``; on by default where capable), or ignore the ops' own
    choice."""
    from dflash_trt.runtime.kernels import triton_ops
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    cpu = torch.device("cpu")
    monkeypatch.delenv("DFLASH_TRT_PDL", raising=False)
    assert TritonOps().launch(cpu) == {"PDL": False}  # the default, where not capable
    assert TritonOps(pdl=False).launch(cpu) == {"PDL": False}
    with pytest.raises(ValueError, match="pdl: programmatic dependent launch needs an sm90\\+ CUDA device .* got cpu"):
        TritonOps(pdl=True).launch(cpu)
    monkeypatch.setattr(triton_ops, "pdl_capable", lambda device: True)  # as on an H100 / H200
    on = {"PDL": True, "launch_pdl": True}
    assert TritonOps().launch(cpu) == on  # the default, where capable
    assert TritonOps(pdl=False).launch(cpu) == {"PDL": False}  # the ops' own choice wins
    monkeypatch.setenv("DFLASH_TRT_PDL", "0")
    assert TritonOps().launch(cpu) == {"PDL": False}  # turned off
    assert TritonOps(pdl=True).launch(cpu) == on  # the ops' own choice wins again
    monkeypatch.setenv("DFLASH_TRT_PDL", "1")
    assert TritonOps().launch(cpu) == on


# ------------------------------------------------------------------ GPU


@gpu
@pytest.mark.parametrize("dtype,small", [(torch.float32, True), (torch.bfloat16, False)])
def test_triton_kernels_equal_twin_and_reference_on_cuda(dtype, small):
    """Bug: a Triton kernel computes something else on the GPU (compiled, not interpreted): wrong tiles at
    M = 1 / 16 / 64 / odd sizes, wrong split combine, wrong RoPE, a write outside the owner's slots."""
    import kernel_checks

    kernel_checks.check_all("cuda", dtype, small=small)


@gpu
def test_fast_bf16_graphs_track_eager_bf16_on_the_shipped_pair():
    """Bug: the fast bf16 path drifts from the eager bf16 path beyond bf16 rounding (a wrong fusion shows
    as large logit errors and low greedy agreement on real text)."""
    import kernel_checks

    report = kernel_checks.shipped_pair_agreement(prompts=16, tokens=256)
    print(report)
    assert report["logit_rel_error"] < 2e-2, report
    assert report["greedy_agreement"] >= 0.97, report
