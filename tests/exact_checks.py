"""Checks of the exact kernels (``runtime/kernels/exact_ops.py``) on any device.

Imported by tests/runtime/test_exact_kernels.py: on CUDA (gpu tests) and, through Triton's
interpreter (``TRITON_INTERPRET=1``, set before import), on CPU tensors. Two kinds of check:

- invariance: a row's (a query's) result is the same BITS whatever else shares the launch: the row
  count and the row's place among them, the queries per owner, the owners, the cache capacity;
- agreement: the exact kernels compute what the reference modules compute, within bf16 rounding.

``dflash_equals_plain`` runs the executor: DFlash's tokens against plain decoding's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_checks import assert_near

from dflash_trt.export.layers import EAGER
from dflash_trt.runtime.kernels.torch_ops import TorchOps

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-identical (-0.0 and +0.0 differ, NaN must match NaN's bits)."""
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    same = got.view(BITS[got.dtype]) == want.view(BITS[want.dtype])
    if not bool(same.all()):
        where = (~same).nonzero()[:4].tolist()
        worst = (got.double() - want.double()).abs().max().item()
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} values differ (first at {where}, max |diff| {worst:.3e})")


def _rand(generator, device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def _linear_cases(generator, device, dtype, N, K, M):
    """(name, weight, options, residual) of every epilogue the fused forwards use."""
    w, wg = _rand(generator, device, dtype, N, K, scale=K**-0.5), _rand(generator, device, dtype, 2 * N, K, scale=K**-0.5)
    g, b, bg = _rand(generator, device, dtype, K) + 1, _rand(generator, device, dtype, N), _rand(generator, device, dtype, 2 * N)
    residual = _rand(generator, device, dtype, M, N)
    return [
        ("plain", w, {}, None),
        ("norm", w, {"norm": g, "eps": 1e-6}, None),
        ("bias", w, {"bias": b}, None),
        ("norm fp32 out (the LM head)", w, {"norm": g, "eps": 1e-6, "out_dtype": torch.float32}, None),
        ("gated norm bias (gate|up)", wg, {"gated": True, "norm": g, "eps": 1e-6, "bias": bg}, None),
        ("residual in place + tap (o, down)", w, {}, residual),
    ]


def _run_linear(ops, x, weight, options, residual):
    """y of ``ops.linear``; with a residual: in place into a copy of it, with the tap in a wider buffer."""
    if residual is None:
        return ops.linear(x, weight, **options), None
    out = residual.clone()
    taps = torch.full((x.shape[0], 2 * out.shape[1]), float("nan"), dtype=out.dtype, device=out.device)
    y = ops.linear(x, weight, residual=out, out=out, tap=taps[:, out.shape[1] :], **options)
    assert y.data_ptr() == out.data_ptr(), "the residual linear did not write in place"
    assert torch.isnan(taps[:, : out.shape[1]]).all(), "the tap store wrote outside its columns"
    return y, taps[:, out.shape[1] :]


def check_linear_rows(device: str, dtype: torch.dtype, small: bool) -> None:
    """Each row of ``linear`` is the same bits for M = 1, 5, 16, 64 (and 300 on a GPU), at any place among them."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    ops, generator = ExactOps(), torch.Generator().manual_seed(10)
    shapes = ((48, 64), (40, 96)) if small else ((96, 320), (1000, 896), (6144, 4096), (4096, 12288))
    total = 70 if small else 300
    subsets = [1, 5, 16, 64] + ([] if small else [100, 200])
    for N, K in shapes:
        x = _rand(generator, device, dtype, total, K)
        for name, weight, options, residual in _linear_cases(generator, device, dtype, N, K, total):
            full, full_tap = _run_linear(ops, x, weight, options, residual)
            for M in subsets:
                rows = torch.randperm(total, generator=generator)[:M].to(device)  # any rows, any order
                part, part_tap = _run_linear(ops, x[rows], weight, options, None if residual is None else residual[rows])
                assert_same_bits(part, full[rows], f"linear {name} {N}x{K} {dtype}: M={M} vs M={total}")
                if full_tap is not None:
                    assert_same_bits(part_tap, full_tap[rows], f"linear tap {N}x{K}: M={M}")


def check_split_rows(device: str, dtype: torch.dtype) -> None:
    """Split-K > 1 under several tilings (2 and 3 splits; K steps 32 and 64; 16 to 32 features; the ordered sum
    as a second launch or by each tile's last split; launches cut at 64 rows by a tiny workspace): each row of ``linear`` (norm, gated, residual + tap epilogues) is the same bits
    for M = 1, 16 and 64 of 70 rows, and within rounding of the fp32 brute-force reference. fp32 runs every
    tiling (its outputs show any change of summation order); bf16 one (the rounding to the weight dtype). On a
    GPU also the 8B q|k|v shape with 4 splits, summed by a second launch and in-kernel."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import ExactLinearPlan, exact_split_k

    generator, total = torch.Generator().manual_seed(15), 70
    plans = (ExactLinearPlan(16, 32, 32, 4, 2), ExactLinearPlan(32, 16, 64, 4, 3, fixup=True), ExactLinearPlan(16, 16, 32, 2, 4, 2))
    cases = [((40, 192), plan) for plan in (plans if dtype == torch.float32 else plans[1:2])]
    if device != "cpu":  # the 8B q|k|v shape, 4 splits, both sums: hundreds of programs racing to the counters
        cases += [((6144, 4096), ExactLinearPlan(32, 64, 128, 4, 4, fixup=fixup)) for fixup in (False, True)]
    for (N, K), plan in cases:
        assert exact_split_k(K, plan)[0] > 1, plan
        ops = ExactOps(linear_plans={(N, K, False): plan, (N, K, True): plan}, workspace_bytes=1)
        x = _rand(generator, device, dtype, total, K)
        for name, weight, options, residual in _linear_cases(generator, device, dtype, N, K, total):
            if name not in ("norm", "gated norm bias (gate|up)", "residual in place + tap (o, down)"):
                continue
            full, full_tap = _run_linear(ops, x, weight, options, residual)
            assert_near(full, _reference_linear(x, weight, options, residual), dtype, f"split linear {name} {plan} vs the reference")
            for M in (1, 16, 64):
                rows = torch.randperm(total, generator=generator)[:M].to(device)
                part, part_tap = _run_linear(ops, x[rows], weight, options, None if residual is None else residual[rows])
                assert_same_bits(part, full[rows], f"split linear {name} {N}x{K} {plan} {dtype}: M={M} vs M={total}")
                if full_tap is not None:
                    assert_same_bits(part_tap, full_tap[rows], f"split linear tap {plan}: M={M}")


def check_wide_rows(device: str, dtype: torch.dtype) -> None:
    """Four 16-row tiles a program as one 64-row tile (``ExactOps(wide_tiles=True)``: on sm90 Hopper's warp-group
    MMA instead of 16-row MMAs): every row the same bits as the 16-row tiles' launch of the same rows and as a
    launch of M = 1 and 16 of them, one split and split-K (summed in-kernel and by a second launch, launches cut at
    64 rows), every epilogue; 70 and 64 rows (a partial 64-row tile and a full one). On a GPU the Qwen3-8B
    weights' shapes with their own plans too, 64 / 128 / 300 rows."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import ExactLinearPlan

    generator = torch.Generator().manual_seed(17)
    plans = (ExactLinearPlan(16, 32, 32, 4, 1), ExactLinearPlan(16, 32, 32, 4, 2), ExactLinearPlan(32, 16, 64, 4, 3, fixup=True))
    cases = [((40, 192), plan, 70) for plan in plans]  # four tiles a program at 64 and 70 rows: the wide tile runs
    if device != "cpu":
        cases += [(shape, None, total) for shape in ((6144, 4096), (4096, 4096), (12288, 4096), (4096, 12288)) for total in (64, 128, 300)]
    for (N, K), plan, total in cases:
        tables = {} if plan is None else {"linear_plans": {(N, K, False): plan, (N, K, True): plan}, "workspace_bytes": 1}
        narrow, wide = ExactOps(wide_tiles=False, **tables), ExactOps(wide_tiles=True, **tables)
        x = _rand(generator, device, dtype, total, K)
        for name, weight, options, residual in _linear_cases(generator, device, dtype, N, K, total):
            if device != "cpu" and K > 192 and name not in ("norm", "gated norm bias (gate|up)", "residual in place + tap (o, down)"):
                continue
            tiles, tiles_tap = _run_linear(narrow, x, weight, options, residual)
            full, full_tap = _run_linear(wide, x, weight, options, residual)
            assert_same_bits(full, tiles, f"wide linear {name} {N}x{K} {plan} {dtype}: {total} rows vs 16-row tiles")
            if full_tap is not None:
                assert_same_bits(full_tap, tiles_tap, f"wide linear tap {N}x{K} {plan}: {total} rows")
            for M in (1, 16, 64):
                rows = torch.randperm(total, generator=generator)[:M].to(device)
                part, _ = _run_linear(wide, x[rows], weight, options, None if residual is None else residual[rows])
                assert_same_bits(part, full[rows], f"wide linear {name} {N}x{K} {plan} {dtype}: M={M} vs M={total}")


def check_fp8_linear(device: str, dtype: torch.dtype) -> None:
    """fp8 weights (``kernels.quant.fp8_rows``, the draft's ``draft_weights="fp8"``) through the exact linear: each
    row the same bits for M = 1, 16 and 64 of 70, one split and split-K (summed by a second launch or in-kernel),
    norm, gated and residual + tap epilogues; within rounding of the fp32 product with the dequantized weight
    (scale applied per feature); the output in x's dtype."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import ExactLinearPlan
    from dflash_trt.runtime.kernels.quant import dequantized, fp8_rows

    generator, total, (N, K) = torch.Generator().manual_seed(16), 70, (40, 192)
    plans = (None, ExactLinearPlan(16, 32, 32, 4, 2), ExactLinearPlan(32, 16, 64, 4, 3, fixup=True))
    for plan in plans:
        ops = ExactOps() if plan is None else ExactOps(linear_plans={(N, K, False): plan, (N, K, True): plan}, workspace_bytes=1)
        x = _rand(generator, device, dtype, total, K)
        for name, weight, options, residual in _linear_cases(generator, device, dtype, N, K, total):
            if name not in ("norm", "gated norm bias (gate|up)", "residual in place + tap (o, down)"):
                continue
            q, scale = fp8_rows(weight)
            full, full_tap = _run_linear(ops, x, q, options | {"scale": scale}, residual)
            assert full.dtype == dtype, (name, full.dtype)
            want = _reference_linear(x, dequantized(q, scale), options, residual)
            assert_near(full, want, dtype, f"fp8 linear {name} {plan} vs the dequantized reference")
            for M in (1, 16, 64):
                rows = torch.randperm(total, generator=generator)[:M].to(device)
                part, part_tap = _run_linear(ops, x[rows], q, options | {"scale": scale}, None if residual is None else residual[rows])
                assert_same_bits(part, full[rows], f"fp8 linear {name} {plan} {dtype}: M={M} vs M={total}")
                if full_tap is not None:
                    assert_same_bits(part_tap, full_tap[rows], f"fp8 linear tap {plan}: M={M}")


def check_exact_target(device: str, dtype: torch.dtype) -> None:
    """A three-layer target's features, taps and logits through ``FastTarget`` with ``ExactOps`` against the same
    forward on the pure-torch twin, within rounding (each layer's norm weights its own, away from 1): the exact
    kernels compose into the twin's forward — norms, q/k-norm + RoPE writing the caches the exact attention reads
    at their strides, residual and tap epilogues, the final norm and fp32 head."""
    import tempfile
    from pathlib import Path

    import tiny_models

    from dflash_trt.export.target import load_target
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.fused import FastTarget

    with tempfile.TemporaryDirectory() as tmp:
        target_dir = tiny_models.write_target(Path(tmp) / "target", num_hidden_layers=3)
        model = load_target(target_dir, tap_layers=(0, 2), dtype=dtype).to(device)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):  # norms away from 1, each its own: a swapped one shows
            layer.input_layernorm.weight.copy_(torch.linspace(0.5, 1.5 + i, layer.input_layernorm.weight.numel()))
            layer.post_attention_layernorm.weight.copy_(torch.linspace(1.8, 0.6 + i, layer.post_attention_layernorm.weight.numel()))
    tokens = torch.randint(0, tiny_models.VOCAB, (2, 6), generator=torch.Generator().manual_seed(4)).to(device)
    start = torch.tensor([0, 3], device=device)
    results = []
    for ops in (ExactOps(), TorchOps()):
        keys, values = model.new_cache(2, 16, device=device)
        with torch.no_grad():
            fast = FastTarget(model, ops)
            x, taps = fast.features(tokens, start, keys, values)
            results.append((x, taps, fast.head(x)))
    bound = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: three layers' roundings, each apart (a wrong norm: ~1)
    for name, got, want in zip(("residual", "taps", "logits"), results[0], results[1]):
        error = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert error <= bound, f"exact target {name} vs the twin ({dtype}): relative error {error:.3e} (at most {bound})"


def check_linear_reference(device: str, dtype: torch.dtype) -> None:
    """``linear`` against the pure-torch twin (same formula) and the reference layers (RMSNorm, Linear, SwiGLU)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    ops, twin, generator = ExactOps(), TorchOps(), torch.Generator().manual_seed(11)
    for M, (N, K) in ((1, (48, 64)), (5, (40, 96)), (37, (48, 64))):
        x = _rand(generator, device, dtype, M, K)
        for name, weight, options, residual in _linear_cases(generator, device, dtype, N, K, M):
            got, _ = _run_linear(ops, x, weight, options, residual)
            want, _ = _run_linear(twin, x, weight, options, residual)
            assert_near(got, want, dtype, f"linear {name} vs the twin, M={M}")
            assert_near(got, _reference_linear(x, weight, options, residual), dtype, f"linear {name} vs the reference, M={M}")


def _reference_linear(x, weight, options, residual):
    """The reference layers' arithmetic: RMSNorm in fp32 rounded to the dtype, F.linear, SiLU-gate, residual add."""
    h = x
    if "norm" in options:
        xf = x.float()
        h = options["norm"] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + options["eps"])).to(x.dtype)
    y = F.linear(h.float(), weight.float(), None if "bias" not in options else options["bias"].float())
    if options.get("gated"):
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y


def _attention_inputs(generator, device, dtype, n, heads, kv_heads, T, D, L):
    q = _rand(generator, device, dtype, n, T, heads, D).transpose(1, 2)
    k, v = (_rand(generator, device, dtype, n, kv_heads, L, D) for _ in range(2))
    return q, k, v


def check_attention_rows(device: str, dtype: torch.dtype, small: bool, slots: int = 520, **tile) -> None:
    """A query's attention is the same bits with 1 or 16 queries per owner, 1 or 3 owners, two capacities,
    the owners' row views or whole pools (any rows), for causal (target), windowed and non-causal (draft) layers;
    and with the splits folded in the attention launch (``combine_in_kernel``) or by a second one, also for
    owners with no visible slot and for owner 0's one live split (in the launch its partial is stored as the
    output, unfolded: the second launch still folds it). ``slots``: the cache's capacity (520: 3 splits of 256
    slots, the default, then 4 with the larger capacity); ``tile``: ``ExactOps``' block_q / split_slots / block_n
    (its defaults without)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    ops, generator = ExactOps(**tile), torch.Generator().manual_seed(12)
    cases = [(4, 2, 16, 16, True, 0), (4, 2, 16, 16, False, 0), (5, 1, 64, 16, True, 0), (4, 2, 16, 7, True, 100)]
    if not small:
        cases += [(32, 8, 128, 16, True, 0), (32, 8, 128, 16, False, 0)]
    elif dtype == torch.float32:
        cases = cases[:2]  # the interpreter's time: fp32 checks the target's and the draft's layer kind
    L, extra = slots, 300
    for heads, kv_heads, D, T, causal, window in cases:
        what = f"attention Hq{heads}/{kv_heads} D{D} T{T} causal {causal} window {window} {dtype}"
        q, k, v = _attention_inputs(generator, device, dtype, 3, heads, kv_heads, T, D, L)
        start = torch.tensor([5, 250, L - T - 4], device=device)  # one split; straddling a split edge; three
        positions, kv_len = start[:, None] + torch.arange(T, device=device), start + T
        full = ops.attention(q, k, v, None, positions, kv_len, causal, window)  # [3, Hq, T, D]
        second = ExactOps(combine_in_kernel=False, **tile).attention(q, k, v, None, positions, kv_len, causal, window)
        assert_same_bits(full, second, f"{what}: splits folded by the last split vs by a second launch")
        for t in (0, T - 1):  # one query per owner: a decode step (causal: the slots up to its own)
            one_len = start + t + 1 if causal else kv_len
            one = ops.attention(q[:, :, t : t + 1].contiguous(), k, v, None, positions[:, t : t + 1], one_len, causal, window)
            assert_same_bits(one[:, :, 0], full[:, :, t], f"{what}: 1 vs {T} queries (query {t})")
        alone = ops.attention(q[1:2], k[1:2], v[1:2], None, positions[1:2], kv_len[1:2], causal, window)
        assert_same_bits(alone[0], full[1], f"{what}: 1 vs 3 owners")
        bigger = [torch.cat([c, _rand(generator, device, dtype, 3, kv_heads, extra, D)], dim=2) for c in (k, v)]
        assert_same_bits(ops.attention(q, *bigger, None, positions, kv_len, causal, window), full, f"{what}: capacity {L} vs {L + extra}")
        rows = torch.tensor([4, 0, 2], device=device)
        pools = [_rand(generator, device, dtype, 5, kv_heads, L, D) for _ in range(2)]
        for pool, view in zip(pools, (k, v)):
            pool[rows] = view
        assert_same_bits(ops.attention(q, *pools, rows, positions, kv_len, causal, window), full, f"{what}: pools at rows vs row views")
    empty = torch.tensor([0, 7, 0], device=device)  # owners with no visible slot: zeros, whoever combines
    q, k, v = _attention_inputs(generator, device, dtype, 3, 4, 2, 5, 16, L)
    positions = torch.arange(5, device=device)[None, :].repeat(3, 1)
    fused = ops.attention(q, k, v, None, positions, empty, False, 0)
    assert not fused[0].any() and not fused[2].any() and fused[1].abs().sum() > 0
    assert_same_bits(fused, ExactOps(combine_in_kernel=False, **tile).attention(q, k, v, None, positions, empty, False, 0), "no visible slot")


def check_attention_rows_split(device: str, dtype: torch.dtype) -> None:
    """``check_attention_rows`` (small) at another split window and inner step: 64 slots in two 32-slot steps, so
    the last owner's query sees five splits (its fold loads four at a time: two rounds; ten splits, three rounds,
    in ``check_attention_reference``). A capacity of 296, not 520: the interpreter's time."""
    check_attention_rows(device, dtype, True, slots=296, split_slots=64, block_n=32)


def check_attention_reference(device: str, dtype: torch.dtype) -> None:
    """``attention`` against the reference (``EagerKernels.attention``, fp32) within bf16 rounding; also at 64-slot
    splits, where a context of 600 slots folds ten splits (three rounds of the fold's loads)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps
    from dflash_trt.runtime.kernels.plan import EXACT_SPLIT_SLOTS

    generator, default = torch.Generator().manual_seed(13), EXACT_SPLIT_SLOTS  # the product's split window
    for n, heads, kv_heads, T, D, L, causal, window, split in ((2, 4, 2, 1, 16, 600, True, 0, default), (2, 4, 2, 5, 16, 600, True, 0, default),
                                                                (3, 5, 1, 16, 64, 520, False, 0, default), (1, 4, 2, 20, 16, 600, True, 7, default),
                                                                (3, 4, 2, 5, 16, 600, True, 0, 64)):
        q, k, v = _attention_inputs(generator, device, dtype, n, heads, kv_heads, T, D, L)
        start = torch.tensor([5, L // 2, L - T - 1][:n], device=device)
        positions, kv_len = start[:, None] + torch.arange(T, device=device), start + T
        want = EAGER.attention(q.float(), k.float(), v.float(), None, positions, kv_len, causal, window)
        got = ExactOps(split_slots=split).attention(q, k, v, None, positions, kv_len, causal, window)
        assert_near(got, want, dtype, f"attention n{n} T{T} D{D} causal {causal} window {window} split {split}")


def check_rope_rows(device: str, dtype: torch.dtype) -> None:
    """q/k-norm + RoPE + KV write: a row's Q and K/V are the same bits written alone or among 16 per owner."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    generator = torch.Generator().manual_seed(14)
    n, heads, kv_heads, D, T, L = 2, 4, 2, 16, 16, 64
    qkv = _rand(generator, device, dtype, n * T, (heads + 2 * kv_heads) * D)
    start = torch.tensor([3, 30], device=device)
    q_norm, k_norm = _rand(generator, device, dtype, D) + 1, _rand(generator, device, dtype, D) + 1
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    caches = [torch.zeros(n, kv_heads, L, D, device=device, dtype=dtype) for _ in range(2)]
    q = ExactOps().qk_rope_write(qkv, start, T, heads, kv_heads, D, q_norm, k_norm, 1e-6, inv_freq, *caches)
    for t in (0, 9):
        singles = [torch.zeros_like(c) for c in caches]
        rows = qkv.view(n, T, -1)[:, t].contiguous()
        one = ExactOps().qk_rope_write(rows, start + t, 1, heads, kv_heads, D, q_norm, k_norm, 1e-6, inv_freq, *singles)
        assert_same_bits(one[:, 0], q[:, t], f"rope q: 1 vs {T} rows (row {t})")
        for single, cache in zip(singles, caches):
            for i in range(n):
                slot = int(start[i]) + t
                assert_same_bits(single[i, :, slot], cache[i, :, slot], f"rope k/v: 1 vs {T} rows (row {t})")


def serve_both(backend, requests, sessions: int) -> dict:
    """Tokens of ``requests`` (``serving.batcher.Request``) served ``sessions`` at a time (continuous
    batching) through one backend, by plain decoding (``speculate=False``) and by DFlash:
    {"plain": [...], "dflash": [...]}, one token list per request. A sampled request draws the same noise
    in both modes (a function of its seed and the position)."""
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.generate import collect, stream

    outputs = {}
    for mode, speculate in (("plain", False), ("dflash", True)):
        with Executor(backend, max_sessions=sessions, speculate=speculate) as executor:
            outputs[mode] = [c.tokens for c in collect(stream(executor, requests, sessions), len(requests))]
    return outputs


def default_pair_requests(count: int, new_tokens: int) -> list:
    """``count`` held-out prompts of the default pair (the last 160 tokens), greedy and top-p sampled (fixed seeds)."""
    import json

    from dflash_trt.export.pair import DEFAULT_PAIR_DIR
    from dflash_trt.export.sampling import Sampling
    from dflash_trt.export.tokenizer import Tokenizer
    from dflash_trt.runtime.serving.batcher import Request

    tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    rows = [json.loads(line) for line in (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [tokenizer.encode(row["prompt"])[-160:] for row in rows[:count]]
    stop = tuple(tokenizer.stop_ids)
    requests = [Request(p, new_tokens, stop, Sampling(0.0, 0, 1.0, 7 + i)) for i, p in enumerate(prompts)]
    return requests + [Request(p, new_tokens, stop, Sampling(0.8, 0, 0.95, 100 + i)) for i, p in enumerate(prompts)]


def first_difference(a: list[int], b: list[int]) -> str:
    """Where two token lists part (for failure messages)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token {at}: {a[at:at + 4]} vs {b[at:at + 4]} (lengths {len(a)}, {len(b)})"
