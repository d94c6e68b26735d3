"""The torch backend's graphs on one GPU at the Qwen3-8B shape: fast kernels vs plain graphed torch.

    python benchmarks/gpu_graphs.py                  # everything below, ~4 min on an H200
    python benchmarks/gpu_graphs.py --sweep          # + the one-row GEMV tile sweep (then used for the timings)
    python benchmarks/gpu_graphs.py --agreement      # + greedy agreement fast vs eager bf16 on the shipped pair

Builds a Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads x 128,
FFN 12288, vocab 151936) and a 5-layer block-16 draft tapping layers 1, 9,
17, 25, 33 with random bf16 weights made on the device (nothing is
downloaded), then measures through ``TorchBackend`` (CUDA graphs on):

- first-start seconds of every graph (Triton compile + warm-up + capture, an
  empty ``TRITON_CACHE_DIR``) and warm-start seconds (a second process, same cache);
- the AR step (``target_prefill`` at T = 1, captured as one CUDA graph);
- ``target_verify_n``, ``draft_n`` and a whole cycle (draft -> verify ->
  verify_argmax -> verdict read on the host) for n = 1..4 at contexts 512 /
  2048 / 8192 of a max_context-16384 pool; verify at max_context 4096 (flat-cost check);
- the plain graphed torch step (``kernels="eager"``: the reference modules in CUDA graphs)
  of the same shape in the same run;
- the fast graphs' outputs against the reference modules' on equal pools (bf16 error,
  argmax agreement) and the attention kernel's time per layer.

Per row: device ms (CUDA events, median), wall ms (host clock around the call
and a sync, median), bytes the graph must move (weights, K/V of the valid
slots, its logits), and the fraction of the 4.8 TB/s HBM roofline. Ends with
one JSON line; rows are appended to ``--results`` (default benchmarks/results.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOFLINE_BYTES_PER_S = 4.8e12
TARGET_SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128)
DRAFT_LAYERS, BLOCK, TAPS = 5, 16, (1, 9, 17, 25, 33)
OWNERS = 4


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--max-context", type=int, default=16384)
    parser.add_argument("--flat-max-context", type=int, default=4096, help="the smaller pool of the flat-cost check")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "dflash-trt-gpu-graphs")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results.jsonl")
    parser.add_argument("--sweep", action="store_true", help="one-row GEMV tile sweep; its best tiles run the timings")
    parser.add_argument("--agreement", action="store_true", help="greedy agreement fast vs eager bf16 on the shipped pair")
    parser.add_argument("--warm-start", action="store_true", help=argparse.SUPPRESS)  # the child process
    return parser.parse_args()


# ---------------------------------------------------------------------- the pair


def build_pair(device):
    """Random bf16 8B-shaped target + draft, made on ``device`` (no host copy of the weights)."""
    import torch

    from dflash_trt.export.config import DraftConfig, RopeConfig, TargetConfig
    from dflash_trt.export.draft import DraftModel
    from dflash_trt.export.layers import Rotary, inverse_frequencies
    from dflash_trt.export.target import TargetModel

    shape = dict(TARGET_SHAPE, rms_norm_eps=1e-6, rope=RopeConfig(theta=1_000_000.0), attention_bias=False, mlp_bias=False, qk_norm=True)
    target_config = TargetConfig(**shape, windows=(0,) * TARGET_SHAPE["num_layers"], max_position_embeddings=40960)
    draft_shape = dict(shape, num_layers=DRAFT_LAYERS)
    draft_config = DraftConfig(**draft_shape, windows=(0,) * DRAFT_LAYERS, block_size=BLOCK, num_target_layers=36, target_layer_ids=TAPS, mask_token_id=151669)
    models = []
    for build in (lambda: TargetModel(target_config, TAPS), lambda: DraftModel(draft_config)):
        with torch.device("meta"):
            model = build().to(torch.bfloat16)
        model = model.to_empty(device=device)
        generator = torch.Generator(device=device).manual_seed(len(models))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.05 * torch.randn(p.shape, device=device, generator=generator))
                else:
                    p.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if isinstance(module, Rotary):
                module.inv_freq = inverse_frequencies(module.rope, module.head_dim).to(device)
        models.append(model.eval())
    return models


def make_dims(target, draft, max_context: int):
    from dflash_trt.export.contract import Dims

    return Dims(
        vocab_size=TARGET_SHAPE["vocab_size"], tap_width=target.tap_width, block_size=BLOCK, proposals=BLOCK - 1,
        max_owners=OWNERS, max_context=max_context, max_chunk=512, target_layers=36, target_kv_heads=8,
        target_head_dim=128, draft_layers=DRAFT_LAYERS, draft_kv_heads=8, draft_head_dim=128, dtype="bfloat16",
    )


def fill_pools(backend) -> None:
    """Random caches: timing never runs on zeros."""
    import torch

    generator = torch.Generator(device=backend.device).manual_seed(7)
    for pool in backend.pools.values():
        for tensor in pool.keys + pool.values:
            tensor.normal_(0.0, 1.0, generator=generator)
    torch.cuda.synchronize()


def shaped_backend(kernels, max_context: int = 4096):
    """The Qwen3-8B-shaped pair on one torch backend with ``kernels`` (``OWNERS`` owners, random caches): (backend, dims)."""
    import torch
    from dflash_trt.runtime.backends import TorchBackend

    target, draft = build_pair(torch.device("cuda"))
    dims = make_dims(target, draft, max_context)
    backend = TorchBackend(target, draft, dims, OWNERS, device="cuda", kernels=kernels)
    fill_pools(backend)
    return backend, dims


# ---------------------------------------------------------------------- bytes


def layer_weight_bytes(layers: int) -> int:
    h, i, d = TARGET_SHAPE["hidden_size"], TARGET_SHAPE["intermediate_size"], TARGET_SHAPE["head_dim"]
    qkv = (TARGET_SHAPE["num_heads"] + 2 * TARGET_SHAPE["num_kv_heads"]) * d * h
    return 2 * layers * (qkv + TARGET_SHAPE["num_heads"] * d * h + 3 * h * i)


def kv_bytes(layers: int, owners: int, slots: int) -> int:
    return 2 * 2 * layers * owners * TARGET_SHAPE["num_kv_heads"] * slots * TARGET_SHAPE["head_dim"]


def head_bytes() -> int:
    return 2 * TARGET_SHAPE["vocab_size"] * TARGET_SHAPE["hidden_size"]


def target_bytes(owners: int, tokens: int, context: int, logits_rows: int) -> int:
    """Weights once, K/V of every valid slot, fp32 logits written."""
    return layer_weight_bytes(36) + head_bytes() + kv_bytes(36, owners, context + tokens) + 4 * logits_rows * TARGET_SHAPE["vocab_size"]


def draft_bytes(owners: int, context: int) -> int:
    h, d, kv = TARGET_SHAPE["hidden_size"], TARGET_SHAPE["head_dim"], TARGET_SHAPE["num_kv_heads"]
    context_kv = 2 * DRAFT_LAYERS * 2 * kv * d * h  # the K|V rows, read again for the context rows
    fc = 2 * h * len(TAPS) * h
    return layer_weight_bytes(DRAFT_LAYERS) + context_kv + fc + head_bytes() + kv_bytes(DRAFT_LAYERS, owners, context + BLOCK)


def roofline(bytes_moved: int, ms: float) -> float:
    return bytes_moved / ROOFLINE_BYTES_PER_S / (ms / 1e3)


# ---------------------------------------------------------------------- timing


def time_calls(stream, call, reps: int) -> tuple[float, float]:
    """(device ms, wall ms) of ``call``, medians over ``reps`` after 2 warm-ups; each call ends in a host sync."""
    import torch

    for _ in range(2):
        call()
        stream.synchronize()
    device, wall = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begun = time.perf_counter()
        start.record(stream)
        call()
        end.record(stream)
        end.synchronize()
        wall.append((time.perf_counter() - begun) * 1e3)
        device.append(start.elapsed_time(end))
    return statistics.median(device), statistics.median(wall)


def alternated_ms(stream, calls: dict, rounds: int, reps: int) -> dict:
    """Device ms of each of ``calls`` (label -> call), taken in turn ``rounds`` times so that a drift of the GPU falls
    on all of them alike: per label, one median of ``reps`` calls per round."""
    import torch

    times = {label: [] for label in calls}
    with torch.cuda.stream(stream):  # a graph replays on the current stream; the events are recorded on this one
        for _ in range(rounds):
            for label, call in calls.items():
                times[label].append(time_calls(stream, call, reps)[0])
    return times


class Feeds:
    """Contract feeds of one (owners, context) point on the device (random tokens, valid positions)."""

    def __init__(self, dims, owners: int, context: int, seed: int = 0) -> None:
        import torch

        from dflash_trt.export import contract as c

        g = torch.Generator(device="cuda").manual_seed(seed)
        v, n = dims.vocab_size, owners
        self.anchor = torch.randint(0, v, (n,), device="cuda", generator=g)
        self.draft = {
            c.CTX_TAPS: torch.randn(n, BLOCK, dims.tap_width, device="cuda", generator=g).to(torch.bfloat16),
            c.CTX_START: torch.full((n,), context - 4, device="cuda"),
            c.CTX_COUNT: torch.full((n,), 4, device="cuda"),
            c.ANCHOR: self.anchor,
        }
        self.verify = {c.TOKENS: torch.randint(0, v, (n, BLOCK), device="cuda", generator=g), c.START: torch.full((n,), context, device="cuda")}
        self.prefill = {c.TOKENS: torch.randint(0, v, (1, 1), device="cuda", generator=g), c.START: torch.full((1,), context, device="cuda")}


def cycle(backend, owners: int, feeds: Feeds):
    """draft_n -> target_verify_n -> verify_argmax_n -> the verdict on the host (what the executor does)."""
    import torch

    from dflash_trt.export import contract as c

    proposals = backend.run(c.graph_name(c.DRAFT, owners), feeds.draft, 0)[c.PROPOSALS]
    candidates = torch.cat([feeds.anchor[:, None], proposals], dim=1)
    logits = backend.run(c.graph_name(c.TARGET_VERIFY, owners), {c.TOKENS: candidates, c.START: feeds.verify[c.START]}, 0)[c.LOGITS]
    verdict = backend.run(c.graph_name(c.VERIFY_ARGMAX, owners), {c.LOGITS: logits, c.CANDIDATES: candidates}, 0)
    return verdict[c.ACCEPTED].cpu()  # host sync: the executor reads every verdict


class ArStep:
    """``target_prefill`` at T = 1 captured as one CUDA graph over row 0 of the backend's target pool."""

    def __init__(self, backend, feeds: Feeds) -> None:
        import torch

        from dflash_trt.export import contract as c

        self.stream = backend.stream.torch
        self.tokens, self.start = feeds.prefill[c.TOKENS].clone(), feeds.prefill[c.START].clone()
        caches = backend.pools["target"].interleaved(0, 1)
        module = backend.modules[c.TARGET_PREFILL]
        with torch.cuda.stream(self.stream), torch.no_grad():
            module(self.tokens, self.start, *caches)  # warm-up: compiles, cuBLAS handles
            self.stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                self.outputs = module(self.tokens, self.start, *caches)

    def at(self, context: int) -> None:
        self.start.fill_(context)

    def __call__(self) -> None:
        self.graph.replay()


# ---------------------------------------------------------------------- sections


def first_start(backend, dims, context: int) -> dict[str, float]:
    """Seconds of each graph's first call (compile + warm-up + capture), in the order a server meets them."""
    import torch

    from dflash_trt.export import contract as c

    seconds = {}
    with torch.cuda.stream(backend.stream.torch):
        for n in range(1, OWNERS + 1):
            feeds = Feeds(dims, n, context, seed=n)
            for kind in (c.DRAFT, c.TARGET_VERIFY, c.VERIFY_ARGMAX):
                began = time.perf_counter()
                if kind == c.DRAFT:
                    backend.run(c.graph_name(kind, n), feeds.draft, 0)
                elif kind == c.TARGET_VERIFY:
                    backend.run(c.graph_name(kind, n), feeds.verify, 0)
                else:
                    logits = torch.zeros(n, BLOCK, dims.vocab_size, device="cuda")
                    backend.run(c.graph_name(kind, n), {c.LOGITS: logits, c.CANDIDATES: feeds.verify[c.TOKENS]}, 0)
                backend.synchronize()
                seconds[c.graph_name(kind, n)] = round(time.perf_counter() - began, 2)
        began = time.perf_counter()
        ArStep(backend, Feeds(dims, 1, context))
        seconds["ar_step(target_prefill T=1)"] = round(time.perf_counter() - began, 2)
    return seconds


def graph_rows(backend, dims, contexts, owners_list, reps: int, label: str, ar: ArStep | None) -> list[dict]:
    """Per (context, owners): AR step, verify_n, draft_n, cycle — device/wall ms, bytes, roofline."""
    import torch

    from dflash_trt.export import contract as c

    rows = []
    stream = backend.stream.torch
    with torch.cuda.stream(stream):
        for context in sorted(contexts):
            ar_ms = ar_wall = None
            if ar is not None:
                ar.at(context)
                ar_ms, ar_wall = time_calls(stream, ar, reps)
            for n in owners_list:
                feeds = Feeds(dims, n, context, seed=context + n)
                verify = time_calls(stream, lambda: backend.run(c.graph_name(c.TARGET_VERIFY, n), feeds.verify, 0), reps)
                draft = time_calls(stream, lambda: backend.run(c.graph_name(c.DRAFT, n), feeds.draft, 0), reps)
                whole = time_calls(stream, lambda: cycle(backend, n, feeds), reps)
                rows.append(row(label, dims, context, n, ar_ms, ar_wall, verify, draft, whole))
                print(format_row(rows[-1]), flush=True)
    return rows


def row(label, dims, context, n, ar_ms, ar_wall, verify, draft, whole) -> dict:
    ar_bytes = target_bytes(1, 1, context, 1)
    verify_bytes, drafted = target_bytes(n, BLOCK, context, n * BLOCK), draft_bytes(n, context)
    return {
        "kernels": label, "max_context": dims.max_context, "context": context, "owners": n,
        "ar_step_ms": _r(ar_ms), "ar_step_wall_ms": _r(ar_wall), "ar_bytes": ar_bytes,
        "ar_roofline_fraction": _r(roofline(ar_bytes, ar_ms)) if ar_ms else None,
        "verify_ms": _r(verify[0]), "verify_wall_ms": _r(verify[1]), "verify_bytes": verify_bytes,
        "verify_roofline_fraction": _r(roofline(verify_bytes, verify[0])),
        "draft_ms": _r(draft[0]), "draft_wall_ms": _r(draft[1]), "draft_bytes": drafted,
        "draft_roofline_fraction": _r(roofline(drafted, draft[0])),
        "cycle_ms": _r(whole[1]), "cycle_device_ms": _r(whole[0]),
        "cycle_cost_ratio": _r(whole[1] / ar_ms) if ar_ms else None,
    }


def _r(value, digits: int = 3):
    return None if value is None else round(value, digits)


def format_row(r: dict) -> str:
    ar = f"AR {r['ar_step_ms']:.3f} ms ({r['ar_roofline_fraction']:.0%})" if r["ar_step_ms"] else "AR -"
    ratio = f"{r['cycle_cost_ratio']:.2f}x" if r["cycle_cost_ratio"] else "-"
    return (
        f"{r['kernels']:6s} L={r['max_context']:5d} ctx={r['context']:5d} n={r['owners']}  {ar}  "
        f"verify {r['verify_ms']:.3f} ms ({r['verify_roofline_fraction']:.0%}, wall {r['verify_wall_ms']:.3f})  "
        f"draft {r['draft_ms']:.3f} ms ({r['draft_roofline_fraction']:.0%})  cycle {r['cycle_ms']:.3f} ms wall "
        f"({r['cycle_device_ms']:.3f} device) = {ratio} AR"
    )


def check_against_eager(fast, eager, dims) -> dict:
    """Same pools, same feeds: the fast graphs' outputs vs the reference modules' (bf16 at the 8B shape)."""
    import torch

    from dflash_trt.export import contract as c

    fill_pools(fast)
    fill_pools(eager)
    result = {}
    for n in (1, OWNERS):
        feeds = Feeds(dims, n, 2048, seed=100 + n)
        outputs = []
        for backend in (fast, eager):
            with torch.cuda.stream(backend.stream.torch):
                verify = backend.run(c.graph_name(c.TARGET_VERIFY, n), feeds.verify, 0)
                draft = backend.run(c.graph_name(c.DRAFT, n), feeds.draft, 0)
                outputs.append({k: v.float().cpu() for k, v in (verify | draft).items()})
        got, want = outputs
        error = lambda key: round(((got[key] - want[key]).norm() / want[key].norm()).item(), 5)  # noqa: E731
        result[n] = {
            "logits_rel_error": error(c.LOGITS), "taps_rel_error": error(c.TAPS),
            "verify_argmax_agreement": round((got[c.LOGITS].argmax(-1) == want[c.LOGITS].argmax(-1)).float().mean().item(), 4),
            "proposals_agreement": round((got[c.PROPOSALS] == want[c.PROPOSALS]).float().mean().item(), 4),
        }
        print(f"  n={n}: {result[n]}", flush=True)
    return result


def copy_bandwidth() -> float:
    """Measured device-to-device copy, bytes read + written per second (the practical ceiling)."""
    import torch

    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    for _ in range(2):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * source.numel() * 5 / (start.elapsed_time(end) / 1e3)


# ---------------------------------------------------------------------- sweep (--sweep)


def sweep_plans() -> list:
    """One-row GEMV tilings tried per weight (block_n, block_k, warps, early_sum)."""
    from dflash_trt.runtime.kernels.plan import LinearPlan as P

    return [P(16, 512, 4, False), P(16, 512, 4, True), P(8, 512, 4, True), P(8, 1024, 4, True), P(16, 1024, 4, True),
            P(16, 1024, 8, True), P(32, 512, 8, True), P(32, 256, 4, True), P(8, 512, 2, True), P(16, 256, 2, True),
            P(64, 128, 4, False), P(4, 1024, 4, True)]


# name -> (N, K, gated, norm, residual, out fp32)
GEMMS = {
    "qkv": (6144, 4096, False, True, False, False),
    "o": (4096, 4096, False, False, True, False),
    "gate_up": (12288, 4096, True, True, False, False),
    "down": (4096, 12288, False, False, True, False),
    "lm_head": (151936, 4096, False, True, False, True),
}


def _gemm_call(ops, name: str, x, weight, norm, residual):
    import torch

    N, K, gated, normed, has_residual, wide = GEMMS[name]
    return ops.linear(
        x, weight, norm=norm if normed else None, eps=1e-6, gated=gated,
        residual=residual if has_residual else None, out_dtype=torch.float32 if wide else None,
    )


def _precompile_job(job) -> float:
    """Worker process: launch one (gemm, plan) once on zeros so Triton compiles it into the disk cache."""
    import torch

    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    name, plan = job
    N, K, gated, *_ = GEMMS[name]
    began = time.perf_counter()
    ops = TritonOps(linear_plans={(N, K, gated): plan})
    weight = torch.zeros((2 * N if gated else N), K, dtype=torch.bfloat16, device="cuda")
    x, norm, residual = (torch.zeros(1, K, dtype=torch.bfloat16, device="cuda"), torch.ones(K, dtype=torch.bfloat16, device="cuda"),
                         torch.zeros(1, N, dtype=torch.bfloat16, device="cuda"))
    _gemm_call(ops, name, x, weight, norm, residual)
    torch.cuda.synchronize()
    return time.perf_counter() - began


def precompile(jobs) -> float:
    """Compile the sweep's kernels in parallel processes (they share TRITON_CACHE_DIR with this one)."""
    import multiprocessing

    began = time.perf_counter()
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(_precompile_job, jobs, chunksize=1)
    return time.perf_counter() - began


def graph_time(stream, calls, reps: int) -> float:
    """ms of one replay of ``calls`` captured as a CUDA graph (median of ``reps``)."""
    import torch

    with torch.cuda.stream(stream):
        calls()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            calls()
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times[1:])


def gemv_sweep(fast, reps: int) -> tuple[list[dict], dict]:
    """Each one-row GEMM of the 8B step over the 36 layers' own weights (no L2 reuse), per plan, + cuBLAS.

    Returns the rows and the best plan per (N, K, gated).
    """
    import torch
    import torch.nn.functional as F

    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    layers, stream = fast.stack.layers, torch.cuda.Stream()
    weights = {"qkv": [L.qkv for L in layers], "o": [L.o for L in layers], "gate_up": [L.gate_up for L in layers],
               "down": [L.down for L in layers], "lm_head": [fast.lm_head] * 4}
    jobs = [(name, plan) for name in GEMMS for plan in sweep_plans()]
    print(f"sweep: compiling {len(jobs)} kernels in parallel: {precompile(jobs):.1f} s", flush=True)
    results, best = [], {}
    for name, (N, K, gated, *_) in GEMMS.items():
        x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
        norm, residual = torch.ones(K, dtype=torch.bfloat16, device="cuda") + 0.1, torch.randn(1, N, device="cuda").to(torch.bfloat16)
        per_call = weights[name][0].numel() * 2
        cublas = graph_time(stream, lambda: [F.linear(x, w) for w in weights[name]], reps) / len(weights[name])
        results.append({"gemm": name, "plan": "cublas", "us": round(cublas * 1e3, 2), "tbps": round(per_call / cublas / 1e9, 3)})
        timed = []
        for plan in sweep_plans():
            ops = TritonOps(linear_plans={(N, K, gated): plan})
            ms = graph_time(stream, lambda: [_gemm_call(ops, name, x, w, norm, residual) for w in weights[name]], reps) / len(weights[name])
            timed.append((ms, plan))
            results.append({"gemm": name, "plan": list(plan.__dict__.values()), "us": round(ms * 1e3, 2), "tbps": round(per_call / ms / 1e9, 3)})
        ms, plan = min(timed, key=lambda item: item[0])
        best[(N, K, gated)] = plan
        print(f"  {name:8s} cuBLAS {cublas * 1e3:7.1f} us ({per_call / cublas / 1e9:.2f} TB/s, no norm/epilogue)   "
              f"fused GEMV {ms * 1e3:7.1f} us ({per_call / ms / 1e9:.2f} TB/s) {plan}", flush=True)
    return results, best


def attention_times(backends: dict, contexts, reps: int) -> list[dict]:
    """The attention kernel alone over the 36 target layers' caches: us per layer, vs the pool's max_context."""
    import torch

    results = []
    for label, backend in backends.items():
        fast, stream = backend.modules["target_verify_1"].target, backend.stream.torch
        pool = backend.pools["target"]
        for tokens, owners in ((1, 1), (1, 4), (BLOCK, 1), (BLOCK, 4)):
            keys, values = pool.rows(0, owners)
            q = torch.randn(owners, tokens, 32, 128, device="cuda").to(torch.bfloat16).transpose(1, 2)
            for context in contexts:
                if context + tokens > backend.dims.max_context:
                    continue
                start = torch.full((owners,), context, device="cuda")
                positions, kv_len = start[:, None] + torch.arange(tokens, device="cuda"), start + tokens
                ms = graph_time(stream, lambda: [fast.ops.attention(q, k, v, None, positions, kv_len, True, 0) for k, v in zip(keys, values)], reps) / 36
                moved = kv_bytes(1, owners, context + tokens)
                results.append({"pool": label, "tokens": tokens, "owners": owners, "context": context, "us_per_layer": round(ms * 1e3, 2), "tbps": round(moved / ms / 1e9, 3)})
                print(f"  attention {label:10s} T={tokens:2d} n={owners} ctx={context:5d}: {ms * 1e3:6.1f} us/layer ({moved / ms / 1e9:.2f} TB/s)", flush=True)
    return results


# ---------------------------------------------------------------------- main


def warm_start_child(args) -> int:
    """Second process, same TRITON_CACHE_DIR: first-call seconds with the compiled kernels on disk."""
    import torch
    from dflash_trt.runtime.backends import TorchBackend

    target, draft = build_pair(torch.device("cuda"))
    dims = make_dims(target, draft, args.flat_max_context)
    with TorchBackend(target, draft, dims, OWNERS, device="cuda", kernels="fast") as backend:
        seconds = first_start(backend, dims, 2048)
    print("WARM " + json.dumps(seconds), flush=True)
    return 0


def warm_start(args) -> dict:
    began = time.perf_counter()
    command = [sys.executable, str(Path(__file__).resolve()), "--warm-start", "--flat-max-context", str(args.flat_max_context)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    line = next((l for l in result.stdout.splitlines() if l.startswith("WARM ")), None)
    if line is None:
        raise RuntimeError(f"warm-start child failed: {result.stdout[-2000:]} {result.stderr[-3000:]}")
    return {"seconds": json.loads(line[5:]), "process_s": round(time.perf_counter() - began, 1)}


class Report:
    """Sections run one by one; a failing section is recorded and the run goes on. Saved after each."""

    def __init__(self, path: Path | None) -> None:
        self.data: dict = {"failures": {}}
        self.path = path

    def section(self, name: str, fn, keep: bool = True):
        began = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - a benchmark keeps going and reports what broke
            self.data["failures"][name] = traceback.format_exc()[-3000:]
            print(self.data["failures"][name], flush=True)
            value = None
        else:
            if keep:
                self.data[name] = value
        print(f"   ({time.perf_counter() - began:.1f} s)", flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))
        return value


def summary(data: dict) -> dict:
    """The goals at context 2048 (issue 13) from the measured rows."""
    rows = [r for r in data.get("fast_rows") or [] if r["context"] == 2048]
    by_n = {r["owners"]: r for r in rows}
    flat = {r["owners"]: r for r in data.get("flat_rows") or [] if r["context"] == 2048}
    reference = {r["owners"]: r for r in data.get("reference_rows") or [] if r["context"] == 2048}
    out = {}
    if 1 in by_n:
        out |= {"ar_step_ms": by_n[1]["ar_step_ms"], "ar_roofline_fraction": by_n[1]["ar_roofline_fraction"]}
        out |= {f"cycle_cost_ratio_n{n}": by_n[n]["cycle_cost_ratio"] for n in by_n}
    if flat:
        out["verify_flat_ratio"] = {n: round(by_n[n]["verify_ms"] / flat[n]["verify_ms"], 3) for n in flat if n in by_n}
    if reference:
        out["reference_ar_step_ms"] = reference[1]["ar_step_ms"]
        out["reference_verify_1_ms"] = reference[1]["verify_ms"]
        out["reference_cycle_1_ms"] = reference[1]["cycle_ms"]
    return out


def results_rows(data: dict, args, machine: str, command: str) -> list[dict]:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    for key in ("fast_rows", "flat_rows", "reference_rows"):
        for r in data.get(key) or []:
            rows.append({"name": "gpu_graphs", "date": date, "machine": machine, "command": command, **r})
    return rows


def main() -> int:
    args = arguments()
    if args.warm_start:
        return warm_start_child(args)
    cache = args.cache_dir / "triton"
    shutil.rmtree(cache, ignore_errors=True)  # first start = an empty compile cache
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    import torch

    from dflash_trt.runtime.backends import TorchBackend
    from dflash_trt.runtime.kernels.triton_ops import TritonOps

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report = Report(out_dir / "gpu_graphs.json" if out_dir else None)
    machine = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, triton {__import__('triton').__version__})"
    command = "python benchmarks/gpu_graphs.py " + " ".join(sys.argv[1:])
    report.data |= {"machine": machine, "command": command}
    report.section("copy_tbps", lambda: round(copy_bandwidth() / 1e12, 3))
    began = time.perf_counter()
    target, draft = build_pair(torch.device("cuda"))
    report.data["build_s"] = round(time.perf_counter() - began, 1)
    dims = make_dims(target, draft, args.max_context)
    cold = TorchBackend(target, draft, dims, OWNERS, device="cuda", kernels="fast")  # the shipped plans
    fill_pools(cold)
    report.section("first_start_s", lambda: first_start(cold, dims, 2048))
    cold.close()
    ops = TritonOps()
    if args.sweep:
        swept = report.section("gemv_sweep", lambda: gemv_sweep(cold.modules["target_verify_1"].target, args.reps), keep=False)
        if swept is not None:
            report.data["gemv_sweep"] = swept[0]
            report.data["gemv_best"] = {str(k): list(v.__dict__.values()) for k, v in swept[1].items()}
            ops = TritonOps(linear_plans=swept[1])
    del cold
    fast = TorchBackend(target, draft, dims, OWNERS, device="cuda", kernels=ops)
    fill_pools(fast)
    ar = report.section("ar_capture", lambda: ArStep(fast, Feeds(dims, 1, 2048)), keep=False)
    report.section("fast_rows", lambda: graph_rows(fast, dims, args.contexts, range(1, OWNERS + 1), args.reps, "fast", ar))
    small = make_dims(target, draft, args.flat_max_context)
    flat = TorchBackend(target, draft, small, OWNERS, device="cuda", kernels=ops)
    fill_pools(flat)
    flat_ar = ArStep(flat, Feeds(small, 1, 2048))
    report.section("flat_rows", lambda: graph_rows(flat, small, [2048], [1, 4], args.reps, "fast", flat_ar))
    eager = TorchBackend(target, draft, small, OWNERS, device="cuda", kernels="eager")
    report.section("check_vs_eager", lambda: check_against_eager(flat, eager, small))
    fill_pools(eager)
    report.section("reference_rows", lambda: graph_rows(eager, small, [2048], [1, 4], args.reps, "eager", ArStep(eager, Feeds(small, 1, 2048))))
    eager.close()
    # about a second: the per-layer attention cost behind the graph numbers
    report.section("attention_us", lambda: attention_times({f"L={dims.max_context}": fast, f"L={small.max_context}": flat}, args.contexts, args.reps))
    flat.close()
    fast.close()
    del target, draft, fast, flat, eager, ar, flat_ar
    torch.cuda.empty_cache()
    report.section("warm_start_s", lambda: warm_start(args))
    if args.agreement:
        sys.path.insert(0, str(ROOT / "tests"))
        report.section("agreement", lambda: __import__("kernel_checks").shipped_pair_agreement(prompts=64, tokens=256))
    report.data["summary"] = summary(report.data)
    rows = results_rows(report.data, args, machine, command)
    with args.results.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"\n{len(rows)} rows appended to {args.results}")
    print(json.dumps({"summary": report.data["summary"], "first_start_s": report.data.get("first_start_s"),
                      "warm_start_s": report.data.get("warm_start_s"), "copy_tbps": report.data.get("copy_tbps"),
                      "failures": sorted(report.data["failures"])}))
    return 1 if report.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
