"""Checks of the Triton kernels against their pure-torch twin and the reference, on any device.

Imported by tests/runtime/test_kernels.py: on CUDA (gpu tests) and, through Triton's
interpreter (``TRITON_INTERPRET=1``, set before import), on CPU tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.export.layers import EAGER
from dflash_trt.runtime.kernels.torch_ops import TorchOps

SHIPPED_PAIR = Path(__file__).resolve().parents[1] / "export" / "default_pair"


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Relative error by norm (METHOD: fp32 far under 1e-3, bf16 operands 1e-3..1e-2); NaN never passes."""
    got, want = got.double().cpu(), want.double().cpu()
    error = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    worst = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()  # one wrong row shows here
    assert error <= _tolerance(dtype) and worst <= 8 * _tolerance(dtype), f"{what}: relative error {error:.3e}, worst {worst:.3e}"


def check_linear(device: str, dtype: torch.dtype, small: bool) -> None:
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    fast, twin = TritonOps(), TorchOps()
    generator = torch.Generator().manual_seed(0)
    rows = (1, 3, 16, 20, 64, 70) if small else (1, 5, 16, 64, 100)
    shapes = ((48, 64), (40, 96)) if small else ((96, 320), (1000, 896))
    for M, (N, K) in ((m, s) for m in rows for s in shapes):
        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

        x, w, wg = rand(M, K), rand(N, K, scale=K**-0.5), rand(2 * N, K, scale=K**-0.5)
        g, b, bg = rand(K), rand(N), rand(2 * N)
        for options in ({}, {"norm": g, "eps": 1e-6}, {"bias": b}, {"out_dtype": torch.float32, "norm": g, "eps": 1e-6}):
            assert_near(fast.linear(x, w, **options), twin.linear(x, w, **options), dtype, f"linear {M}x{N}x{K} {sorted(options)}")
        gated = {"gated": True, "norm": g, "eps": 1e-6, "bias": bg}
        assert_near(fast.linear(x, wg, **gated), twin.linear(x, wg, **gated), dtype, f"gated {M}x{N}x{K}")
        residual, taps = rand(M, N), torch.full((M, 2 * N), float("nan"), device=device, dtype=dtype)
        expected = twin.linear(x, w, residual=residual.clone())
        out = fast.linear(x, w, residual=residual, out=residual, tap=taps[:, N:])
        assert out.data_ptr() == residual.data_ptr()
        assert_near(out, expected, dtype, f"residual {M}x{N}x{K}")
        assert_near(taps[:, N:], expected, dtype, "tap")
        assert torch.isnan(taps[:, :N]).all(), "the tap store wrote outside its columns"


def check_rope_write(device: str, dtype: torch.dtype) -> None:
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    generator = torch.Generator().manual_seed(1)
    for heads, kv_heads, D, T, n in ((4, 2, 16, 3, 2), (5, 1, 64, 1, 3), (0, 2, 16, 4, 2), (32, 8, 128, 16, 2)):
        L = 48
        qkv = torch.randn(n * T, (heads + 2 * kv_heads) * D, generator=generator).to(device=device, dtype=dtype)
        start = torch.tensor([3, 17, 30][:n], device=device)
        caches = [torch.randn(n, kv_heads, L, D, generator=generator).to(device=device, dtype=dtype) for _ in range(2)]
        twin_caches, before = [t.clone() for t in caches], [t.clone() for t in caches]
        q_norm, k_norm = (torch.randn(D, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
        inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
        args = (start, T, heads, kv_heads, D, q_norm, k_norm, 1e-6, inv_freq)
        q = TritonOps().qk_rope_write(qkv, *args, *caches)
        q_twin = TorchOps().qk_rope_write(qkv, *args, *twin_caches)
        if heads:
            assert_near(q, q_twin, dtype, f"rope q {heads}/{kv_heads}/{D}")
        written = torch.zeros(n, L, dtype=torch.bool)
        for i, s in enumerate(start.tolist()):
            written[i, s : s + T] = True
        for got, want, old, name in zip(caches, twin_caches, before, ("k", "v")):
            for i in range(n):
                assert_near(got[i][:, written[i]], want[i][:, written[i]], dtype, f"rope {name} cache {heads}/{kv_heads}/{D} owner {i}")
                assert torch.equal(got[i][:, ~written[i]].cpu(), old[i][:, ~written[i]].cpu()), f"rope {name}: a write outside the owner's slots"


def check_attention(device: str, dtype: torch.dtype, small: bool) -> None:
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    generator = torch.Generator().manual_seed(2)
    cases = [(2, 4, 2, 1, 16, 64, True, 0), (2, 4, 2, 5, 16, 64, True, 0), (3, 5, 1, 16, 64, 80, False, 0), (1, 4, 2, 20, 16, 64, True, 7)]
    if not small:
        cases += [(1, 32, 8, 1, 128, 4096, True, 0), (4, 32, 8, 16, 128, 2048, True, 0), (2, 32, 8, 16, 128, 1024, False, 0), (1, 8, 2, 300, 64, 512, True, 0)]
    for n, heads, kv_heads, T, D, L, causal, window in cases:
        q = torch.randn(n, T, heads, D, generator=generator).to(device=device, dtype=dtype).transpose(1, 2)
        k, v = (torch.randn(n, kv_heads, L, D, generator=generator).to(device=device, dtype=dtype) for _ in range(2))
        start = torch.tensor([5, L // 3, L - T - 1, L // 2][:n], device=device)
        positions, kv_len = start[:, None] + torch.arange(T, device=device), start + T
        want = EAGER.attention(q.float(), k.float(), v.float(), None, positions, kv_len, causal, window)
        for splits in (None, 1, 3):
            got = TritonOps(splits).attention(q, k, v, None, positions, kv_len, causal, window)
            assert_near(got, want, dtype, f"attention n{n} T{T} D{D} L{L} causal {causal} window {window} splits {splits}")


def check_rows(device: str, dtype: torch.dtype) -> None:
    """Row-indexed calls (whole pools + ``rows``): the same K/V writes and attention as the owners' row views."""
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    generator = torch.Generator().manual_seed(3)
    n, heads, kv_heads, D, T, L, R = 3, 4, 2, 16, 5, 48, 6
    rows = torch.tensor([4, 0, 2], device=device)  # any rows, any order
    qkv = torch.randn(n * T, (heads + 2 * kv_heads) * D, generator=generator).to(device=device, dtype=dtype)
    start = torch.tensor([3, 17, 30], device=device)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))).to(device)
    pools = [torch.randn(R, kv_heads, L, D, generator=generator).to(device=device, dtype=dtype) for _ in range(2)]
    twin_pools, views = [t.clone() for t in pools], [t[rows].clone() for t in pools]
    args = (start, T, heads, kv_heads, D, None, None, 1e-6, inv_freq)
    q = TritonOps().qk_rope_write(qkv, *args, *pools, rows)
    q_view = TritonOps().qk_rope_write(qkv, *args, *views)
    TorchOps().qk_rope_write(qkv, *args, *twin_pools, rows)
    assert torch.equal(q.cpu(), q_view.cpu()), "rows: another Q than the row views'"
    for pool, twin, view in zip(pools, twin_pools, views):
        assert torch.equal(pool[rows].cpu(), view.cpu()), "rows: other K/V writes than the row views'"
        assert_near(pool, twin, dtype, "rows: the twin's K/V writes")
        others = [r for r in range(R) if r not in rows.tolist()]
        assert torch.equal(pool[others].cpu(), twin[others].cpu()), "rows: a write to a row no owner has"
    positions, kv_len = start[:, None] + torch.arange(T, device=device), start + T
    for splits in (1, 3):
        got = TritonOps(splits).attention(q.transpose(1, 2), *pools, rows, positions, kv_len, True, 0)
        want = TritonOps(splits).attention(q.transpose(1, 2), *views, None, positions, kv_len, True, 0)
        assert torch.equal(got.cpu(), want.cpu()), f"rows: another attention than the row views' (splits {splits})"


def check_embed(device: str, dtype: torch.dtype) -> None:
    """``embed`` (the target's tokens, the draft's anchor + masks, scaled or not): the twin's rows bit for bit,
    its positions and lengths; fp32 and bf16 tables (the scale rounded once, as torch's ``x * scale``)."""
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    generator = torch.Generator().manual_seed(5)
    for table_dtype in (torch.float32, torch.bfloat16, dtype):
        table = torch.randn(37, 1100, generator=generator).to(device=device, dtype=table_dtype)  # H past one 1024 step
        start = torch.tensor([0, 9, 130], device=device)
        tokens = torch.randint(0, 37, (3, 5), generator=generator).to(device)
        anchor = torch.tensor([4, 36, 0], device=device)
        cases = [("tokens", dict(tokens=tokens)), ("block", dict(anchor=anchor, mask_id=31, block=6)),
                 ("block scaled", dict(anchor=anchor, mask_id=31, block=6, scale=0.7071)),
                 ("tokens, a column view", dict(tokens=tokens.t().contiguous().t())), ("anchor, a strided view", dict(anchor=tokens[:, 2], mask_id=3, block=4))]
        for name, options in cases:
            got = TritonOps().embed(table, start, **options)
            want = TorchOps().embed(table, start, **options)
            for part, g, w in zip(("rows", "positions", "lengths"), got, want):
                assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), f"embed {name} {table_dtype}: {part} differ from the twin's"


def check_all(device: str, dtype: torch.dtype, small: bool) -> None:
    check_embed(device, dtype)
    check_linear(device, dtype, small)
    check_rope_write(device, dtype)
    check_attention(device, dtype, small)
    check_rows(device, dtype)


def shipped_pair_agreement(prompts: int = 16, tokens: int = 256, device: str = "cuda") -> dict:
    """Teacher-forced next-token choices of the shipped target, bf16, fast vs eager, over its prompts.

    Returns the greedy agreement (share of positions with the same argmax) and the relative logit error.
    """
    import copy
    import json

    from dflash_trt.export.target import load_target
    from dflash_trt.export.tokenizer import Tokenizer
    from dflash_trt.runtime.kernels import default_ops
    from dflash_trt.runtime.kernels.fused import FastTarget

    eager = load_target(SHIPPED_PAIR / "target", dtype=torch.bfloat16).to(device)
    fast = FastTarget(copy.deepcopy(eager), default_ops(torch.device(device)))
    tokenizer = Tokenizer.from_dir(SHIPPED_PAIR / "target")
    lines = (SHIPPED_PAIR / "prompts.jsonl").read_text().splitlines()[:prompts]
    same = total = 0
    error = norm = 0.0
    for line in lines:
        ids = tokenizer.encode(json.loads(line)["prompt"])[:tokens]
        batch = torch.tensor([ids], device=device)
        start = torch.zeros(1, dtype=torch.int64, device=device)
        with torch.no_grad():
            keys, values = eager.new_cache(1, len(ids), device=device)
            want, _ = eager(batch, start, None, keys, values)
            keys, values = eager.new_cache(1, len(ids), device=device)
            x, _ = fast.features(batch, start, keys, values)
            got = fast.head(x)
        same += (got.argmax(-1) == want[0].argmax(-1)).sum().item()
        total += len(ids)
        error += (got - want[0]).double().norm().item() ** 2
        norm += want.double().norm().item() ** 2
    return {"prompts": len(lines), "positions": total, "greedy_agreement": same / total, "logit_rel_error": (error / norm) ** 0.5}
