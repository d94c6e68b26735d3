"""Where a many-session round spends its host time: the executor under continuous batching, profiled.

    python benchmarks/host_profile.py [--sessions 64] [--requests 256] [--max-new-tokens 64] [--no-draft] [--device cuda] [--record]

The default pair (bf16 on CUDA, fp32 on the CPU) on the torch backend, ``--sessions`` sessions at once
(one row-indexed program serves up to that many owners), ``generate.stream`` over ``--requests``
held-out prompts: a warm-up pass (start-up captures and compiles), then a timed pass under cProfile.
Prints the device timeline (launches, device-busy and idle milliseconds between launches, from the
loop's own events), the wall time, tokens/s, and the functions with the most host time of their own;
ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from gpu_e2e import default_pair, dims_of, machine  # noqa: E402

from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.generate import stream  # noqa: E402
from dflash_trt.runtime.serving.batcher import Request  # noqa: E402


def serve(executor: Executor, requests: list[Request], sessions: int) -> tuple[int, float]:
    executor.backend.synchronize()
    started = time.perf_counter()
    tokens = sum(len(chunk.tokens) for chunk in stream(executor, requests, sessions))
    executor.backend.synchronize()
    return tokens, time.perf_counter() - started


def top_functions(profile: cProfile.Profile, count: int) -> list[dict]:
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (calls, _, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls": calls, "own_s": round(own, 4), "cumulative_s": round(cumulative, 4)})
    return sorted(rows, key=lambda row: -row["own_s"])[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-draft", action="store_true", help="plain target decoding (the baseline)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, draft, prompts, stop = default_pair(dtype)
    dims = dims_of(target, draft, args.sessions, dtype)
    backend = TorchBackend(target, draft, dims, args.sessions, device=args.device)
    requests = [Request(prompts[i % len(prompts)], args.max_new_tokens, stop) for i in range(args.requests)]
    with Executor(backend, max_sessions=args.sessions, speculate=not args.no_draft) as executor:
        serve(executor, requests[: args.sessions * 2], args.sessions)  # warm-up: captures, compiles, allocator
        executor.loop.timeline.reset()
        profile = cProfile.Profile()
        profile.enable()
        tokens, seconds = serve(executor, requests, args.sessions)
        profile.disable()
        timeline = executor.loop.timeline
        result = {
            "name": "host_profile", "date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(["python", *sys.argv]),
            "sessions": args.sessions, "requests": args.requests, "speculate": not args.no_draft, "tokens": tokens,
            "wall_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), "launches": timeline.launches,
            "device_busy_ms": round(timeline.busy_ms, 1), "device_idle_ms": round(timeline.idle_ms, 1),
            "top": top_functions(profile, args.top),
        }
    backend.close()
    print(f"{tokens} tokens in {seconds:.2f} s ({result['tokens_per_s']} tok/s); {timeline.launches} launches, "
          f"device busy {result['device_busy_ms']} ms, idle between launches {result['device_idle_ms']} ms (profiled: host times inflated)")
    print("| function | calls | own s | cumulative s |\n| --- | --- | --- | --- |")
    for row in result["top"]:
        print(f"| {row['function']} | {row['calls']} | {row['own_s']} | {row['cumulative_s']} |")
    print(json.dumps(result))
    if args.record:
        record.append_rows([result])


if __name__ == "__main__":
    main()
