"""Where a many-session round spends its host time: the executor under continuous batching, profiled.

    python benchmarks/host_profile.py [--sessions 64] [--requests 256] [--max-new-tokens 64] [--no-draft]
        [--device cuda] [--torch-kernels auto|fast|exact|eager] [--timed | --kernels | --boundaries] [--record]
    python benchmarks/host_profile.py --device cpu --torch-kernels fast --timed   # a GPU round's host work, on a CPU
    python benchmarks/host_profile.py --sessions 1 --requests 12 --max-new-tokens 128 --boundaries   # execute gaps

The default pair (bf16 on CUDA, fp32 on the CPU) on the torch backend, ``--sessions`` sessions at once
(one row-indexed program serves up to that many owners), ``generate.stream`` over ``--requests``
held-out prompts: a warm-up pass (start-up captures and compiles), then a measured pass. Prints the
device timeline (launches, device-busy and idle milliseconds between launches, from the loop's own
events), the wall time and tokens/s, then one of:

- (default) the functions with the most host time of their own, under cProfile (host times inflated);
- ``--timed``: host microseconds per call of the round's own functions (``ROUND_FUNCTIONS``), timed
  with ``perf_counter`` around each call, no profiler: what a launch, a read, a prefill cost as they run;
- ``--kernels`` (CUDA): the device kernels under ``torch.profiler``, as counts and microseconds per
  launch of the loop (prefill kernels included): how many kernels a cycle or a decode step is made of;
- ``--boundaries``: the host time around execute boundaries, where nothing is queued on the device (medians
  of ``perf_counter`` marks): the execute's last read after its wait for the device, from that read to the
  execute's end, from one execute's end to the next one's start, from an execute's start to its first
  launch. Their sum is about what the device idles per boundary.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from gpu_e2e import default_pair, dims_of, machine  # noqa: E402

from dflash_trt.runtime import device_loop, executor as executor_module, launches, stats, timing  # noqa: E402
from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.generate import stream  # noqa: E402
from dflash_trt.runtime.serving.batcher import Request  # noqa: E402

# (class, method) pairs ``--timed`` times: an execute's parts, a launch's and a read's.
ROUND_FUNCTIONS = [
    (executor_module.Executor, name)
    for name in ("_execute", "_target_work", "_plan_prefill", "_launch_prefills", "_join", "_decode", "_plan_round", "_pack", "_launch", "_read", "_read_cycles", "_read_decodes")
] + [(device_loop.DeviceLoop, name) for name in ("stage", "launch", "read")] + [
    (timing.Timeline, "wait"), (stats.StatsLog, "cycle_rows"), (stats.StatsLog, "decode_rows"), (launches.Lane, "add"), (launches.Lane, "may_launch"),
]


def serve(executor: Executor, requests: list[Request], sessions: int) -> tuple[int, float]:
    executor.backend.synchronize()
    started = time.perf_counter()
    tokens = sum(len(chunk.tokens) for chunk in stream(executor, requests, sessions))
    executor.backend.synchronize()
    return tokens, time.perf_counter() - started


def top_functions(profile: cProfile.Profile, count: int) -> list[dict]:
    stats_ = pstats.Stats(profile)
    rows = []
    for (path, line, name), (calls, _, own, cumulative, _) in stats_.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls": calls, "own_s": round(own, 4), "cumulative_s": round(cumulative, 4)})
    return sorted(rows, key=lambda row: -row["own_s"])[:count]


@contextmanager
def wrapped(methods: list[tuple[type, str]], wrapper):
    """Each (class, method) replaced by ``wrapper(function, owner, name)`` inside the block, restored after."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in methods]
    for owner, name, function in originals:
        setattr(owner, name, wrapper(function, owner, name))
    try:
        yield
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)


@contextmanager
def timed_calls(functions: list[tuple[type, str]]):
    """Each (class, method) wrapped with a perf_counter timer for the body; yields {label: [calls, seconds]}."""
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])

    def wrap(function, owner, name):
        total = totals[f"{owner.__name__}.{name}"]

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                total[0] += 1
                total[1] += time.perf_counter() - started
        return timed

    with wrapped(functions, wrap):
        yield totals


# (class, method) -> the tag of its marks in ``boundary_marks``
BOUNDARY_TAGS = {(executor_module.Executor, "_execute"): "X", (device_loop.DeviceLoop, "launch"): "L",
                 (executor_module.Executor, "_read"): "R", (device_loop.DeviceLoop, "read"): "W"}


@contextmanager
def boundary_marks():
    """``(tag, perf_counter)`` marks at the entry (``<``) and exit (``>``) of ``Executor._execute`` (X),
    ``DeviceLoop.launch`` (L), ``Executor._read`` (R) and its wait, ``DeviceLoop.read`` (W); yields the list."""
    marks: list[tuple[str, float]] = []

    def wrap(function, owner, name):
        tag = BOUNDARY_TAGS[owner, name]

        def marked(*args, **kwargs):
            marks.append((tag + "<", time.perf_counter()))
            try:
                return function(*args, **kwargs)
            finally:
                marks.append((tag + ">", time.perf_counter()))
        return marked

    with wrapped(list(BOUNDARY_TAGS), wrap):
        yield marks


def boundary_rows(marks: list[tuple[str, float]]) -> list[dict]:
    """Medians (µs) of the execute-boundary spans in ``boundary_marks``' marks (executes with a launch only)."""
    spans: dict[str, list[float]] = defaultdict(list)
    previous_end = start = launched = waited = read_end = processing = None
    for tag, t in marks:
        if tag == "X<":
            if previous_end is not None:
                spans["previous execute's end -> this one's start"].append(t - previous_end)
            start, launched, read_end = t, False, None
        elif tag == "L<" and not launched:
            launched = True
            spans["execute's start -> its first launch"].append(t - start)
        elif tag == "W>":
            waited = t
        elif tag == "R>":
            read_end, processing = t, t - waited
        elif tag == "X>":
            previous_end = t
            if launched and read_end is not None:
                spans["last read, after its wait"].append(processing)
                spans["last read's end -> execute's end"].append(t - read_end)
    return [{"span": name, "count": len(values), "median_us": round(statistics.median(values) * 1e6, 1)}
            for name, values in spans.items() if values]


def timed_rows(totals: dict[str, list]) -> list[dict]:
    rows = [{"function": label, "calls": calls, "us_per_call": round(seconds / calls * 1e6, 1), "total_ms": round(seconds * 1e3, 1)}
            for label, (calls, seconds) in totals.items() if calls]
    return sorted(rows, key=lambda row: -row["total_ms"])


def kernel_rows(profiler, launches: int) -> list[dict]:
    """Device kernels (memcpys and host-side events left out) by total time, with counts per loop launch."""
    rows = []
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0 or event.key.startswith(("aten::", "Memcpy", "Memset", "cuda")):
            continue
        rows.append({"kernel": event.key[:80], "count": event.count, "per_launch": round(event.count / max(launches, 1), 2), "total_us": round(device_us, 1)})
    return sorted(rows, key=lambda row: -row["total_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-draft", action="store_true", help="plain target decoding (the baseline)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--torch-kernels", default="auto", choices=("auto", "fast", "exact", "eager"),
                        help="the torch backend's kernels (on the CPU, fast runs the kernels' twin as row-indexed programs: "
                             "launches of every owner, as on a GPU, where the default eager modules pack owners by consecutive rows)")
    parser.add_argument("--top", type=int, default=25)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--timed", action="store_true", help="host µs per call of the round's functions, no profiler")
    how.add_argument("--kernels", action="store_true", help="the device kernels under torch.profiler (CUDA)")
    how.add_argument("--boundaries", action="store_true", help="host µs around execute boundaries (nothing queued on the device)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.kernels and args.device != "cuda":
        parser.error(f"--kernels counts device kernels: it needs --device cuda, got --device {args.device}")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, draft, prompts, stop = default_pair(dtype)
    dims = dims_of(target, draft, args.sessions, dtype)
    backend = TorchBackend(target, draft, dims, args.sessions, device=args.device, kernels=args.torch_kernels)
    requests = [Request(prompts[i % len(prompts)], args.max_new_tokens, stop) for i in range(args.requests)]
    mode = "timed" if args.timed else "kernels" if args.kernels else "boundaries" if args.boundaries else "cprofile"
    with Executor(backend, max_sessions=args.sessions, speculate=not args.no_draft) as executor:
        serve(executor, requests[: args.sessions * 2], args.sessions)  # warm-up: captures, compiles, allocator
        executor.loop.timeline.reset()
        profile = cProfile.Profile() if mode == "cprofile" else None
        if mode == "kernels":
            measuring = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        else:
            measuring = timed_calls(ROUND_FUNCTIONS) if mode == "timed" else boundary_marks() if mode == "boundaries" else nullcontext()
        with measuring as measured:
            if profile is not None:
                profile.enable()
            tokens, seconds = serve(executor, requests, args.sessions)
            if profile is not None:
                profile.disable()
        timeline = executor.loop.timeline
        result = {
            "name": "host_profile", "date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(["python", *sys.argv]),
            "sessions": args.sessions, "requests": args.requests, "speculate": not args.no_draft, "mode": mode, "tokens": tokens,
            "wall_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), "launches": timeline.launches,
            "device_busy_ms": round(timeline.busy_ms, 1), "device_idle_ms": round(timeline.idle_ms, 1),
        }
        if mode == "cprofile":
            result["top"] = top_functions(profile, args.top)
        elif mode == "timed":
            result["top"] = timed_rows(measured)
        elif mode == "boundaries":
            result["top"] = boundary_rows(measured)
        else:
            result["top"] = kernel_rows(measuring, timeline.launches)[: args.top]
    backend.close()
    note = {"cprofile": " (profiled: host times inflated)", "timed": "", "boundaries": "", "kernels": " (profiled: device times inflated)"}[mode]
    print(f"{tokens} tokens in {seconds:.2f} s ({result['tokens_per_s']} tok/s); {timeline.launches} launches, "
          f"device busy {result['device_busy_ms']} ms, idle between launches {result['device_idle_ms']} ms{note}")
    columns = list(result["top"][0]) if result["top"] else []
    print("| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns))
    for row in result["top"]:
        print("| " + " | ".join(str(row[column]) for column in columns) + " |")
    print(json.dumps(result))
    if args.record:
        record.append_rows([result])


if __name__ == "__main__":
    main()
