"""Cost of the token choice (``export.sampling.choose``) for one verify row block, on a CUDA GPU.

One verify block of one owner is P+1 = 16 rows of V logits (fp32); every row
goes through the whole definition whatever its parameters (temperature, top-k
via TopK, 20 top-p bisection steps, the int64 hash and the Gumbel noise), so
the rows mix greedy, untruncated, top-k and top-p settings. Timed with CUDA
events over replays of one CUDA graph (no launch overhead, no host syncs):

- ``fused``: the torch backend's CUDA kernel of the op (``runtime/kernels/sampling.py``:
  ten Triton passes);
- ``eager``: the PyTorch definition, one kernel per op (~130 kernels);
- ``compiled``: the same function under ``torch.compile`` (Inductor fuses the
  elementwise work; optional, ``--compile``);
- ``noise`` / ``kept`` / ``topk``: parts of the eager module (hash + Gumbel
  noise; top-k + top-p; the TopK of K = 3840 alone), to show where the time goes.

Correctness: the GPU's tokens are compared with the CPU's on the same logits
(the backends must agree, docs/design.md §6). Prints a table and ends with one JSON line.

``--profile`` also prints the fused kernel's launches with their device time
(torch.profiler, outside a graph: where the time goes).

    python benchmarks/sampling_speed.py [--rows 16] [--vocab 151936] [--repeats 100] [--compile] [--profile] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_trt.export import sampling
from dflash_trt.export.sampling import choose, seed_parts

SETTINGS = ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 50, 0.9), (1.0, 0, 0.9), (0.6, 3840, 1.0), (1.5, 0, 0.5))


def inputs(rows: int, vocab: int, device) -> tuple[torch.Tensor, ...]:
    """logits [rows, V] ~ 3 N(0, 1), per-row settings cycling through SETTINGS, seeds, positions."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(rows, vocab, generator=generator)
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(rows)]
    temperature = torch.tensor([t for t, _, _ in settings], dtype=torch.float32)
    top_k = torch.tensor([k for _, k, _ in settings], dtype=torch.int64)
    top_p = torch.tensor([p for _, _, p in settings], dtype=torch.float32)
    seed = torch.tensor([seed_parts(1234 + i) for i in range(rows)], dtype=torch.int64)
    position = torch.arange(rows, dtype=torch.int64) + 1000
    return tuple(t.to(device) for t in (logits, temperature, top_k, top_p, seed, position))


def noise_only(logits, temperature, top_k, top_p, seed, position):
    return sampling.noise(seed, position[:, None], logits.shape[-1])


def kept_only(logits, temperature, top_k, top_p, seed, position):
    z = logits / torch.where(temperature <= 0, 1.0, temperature)[:, None]
    return sampling.kept(z, top_k[:, None], top_p[:, None], logits.shape[-1])


def topk_only(logits, temperature, top_k, top_p, seed, position):
    return torch.topk(logits, sampling.top_k_limit(logits.shape[-1]), dim=-1).values


def time_graph(function, args, repeats: int) -> tuple[float, torch.Tensor]:
    """Mean ms per call over ``repeats`` replays of one CUDA graph of ``function(*args)``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            function(*args)  # warm-up: lazy inits, autotuning, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        result = function(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats, result


def kernel_times(function, args, repeats: int) -> list[dict]:
    """Per-launch device time of ``function(*args)`` (torch.profiler, mean over ``repeats`` calls), in launch order."""
    from torch.profiler import ProfilerActivity, profile

    function(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            function(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = len(events) // repeats
    rows = []
    for i in range(per_call):
        mine = events[i::per_call]
        rows.append({"kernel": mine[0].name[:60], "us": round(sum(e.device_time for e in mine) / len(mine), 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile(choose)")
    parser.add_argument("--profile", action="store_true", help="also print the fused kernel's launches and their device time")
    parser.add_argument("--out", type=Path, help="write the JSON line here too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cpu = inputs(args.rows, args.vocab, "cpu")
    gpu = inputs(args.rows, args.vocab, "cuda")
    from dflash_trt.runtime.kernels.sampling import choose_cuda

    variants = (("fused", choose_cuda), ("eager", choose), ("noise", noise_only), ("kept", kept_only), ("topk", topk_only))
    with torch.no_grad():
        want = choose(*cpu)
        rows = []
        for name, function in variants:
            ms, result = time_graph(function, gpu, args.repeats)
            agree = int((result.cpu() == want).sum()) if name in ("fused", "eager") else None
            rows.append({"variant": name, "ms": round(ms, 4), "agree": agree})
        if args.compile:
            started = time.perf_counter()
            compiled = torch.compile(choose, fullgraph=True, dynamic=False)
            compiled(*gpu)
            compile_s = time.perf_counter() - started
            ms, result = time_graph(compiled, gpu, args.repeats)
            rows.append({"variant": "compiled", "ms": round(ms, 4), "agree": int((result.cpu() == want).sum()), "compile_s": round(compile_s, 1)})
    print(f"{'variant':10s} {'ms/block':>9s} {'agree':>7s}   ({args.rows} x {args.vocab} fp32 logits, {torch.cuda.get_device_name()})")
    for row in rows:
        agree = "" if row["agree"] is None else f"{row['agree']}/{args.rows}"
        print(f"{row['variant']:10s} {row['ms']:9.4f} {agree:>7s}")
    record = {"name": "sampling_speed", "rows": args.rows, "vocab": args.vocab, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "results": rows}
    if args.profile:
        try:
            with torch.no_grad():
                launches = kernel_times(choose_cuda, gpu, 20)
        except Exception as error:  # the profiler needs CUPTI; the timings above stand without it
            print(f"no profile: {error!r}")
            launches = []
        print(f"fused launches (outside a graph, mean of 20 calls): {sum(r['us'] for r in launches):.1f} us of kernels")
        for launch in launches:
            print(f"  {launch['us']:8.2f} us  {launch['kernel']}")
        record["launches"] = launches
    line = json.dumps(record)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
